"""Prefill's prompt passes and decode's steps take turns on one server's cores
(pdchat.ensemble.core_turns): decode waits for a marked pass once, never past its deadline."""

from pdchat.ensemble.core_turns import IN_USE_S, MAX_TURN_S, MIN_TURN_S, PassMarks, PassTurns
from pdchat.ensemble.decode_load import LoadSlot


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def turns_and_marks(tmp_path, on_poll=None):
    clock = Clock()
    polls = []

    def sleep(seconds: float) -> None:
        clock.now += seconds
        polls.append(seconds)
        if on_poll is not None:
            on_poll(len(polls))

    LoadSlot(tmp_path, "decode_0_0", 4096).set(3)  # a decode serves three sequences beside it
    marks = PassMarks(tmp_path, clock=clock)
    return PassTurns(tmp_path, clock=clock, sleep=sleep), marks, clock, polls


def test_with_no_pass_running_a_step_does_not_wait(tmp_path):
    turns, marks, _, polls = turns_and_marks(tmp_path)
    assert turns.wait() == 0.0
    marks.begin()
    marks.end()
    assert turns.wait() == 0.0 and polls == []


def test_a_step_waits_for_a_running_pass_until_it_ends_and_then_steps_once_before_the_next(tmp_path):
    ended = {}

    def end_after_ten_polls(count: int) -> None:
        if count == 10:
            marks.end()
            ended["at"] = count

    turns, marks, _, polls = turns_and_marks(tmp_path, end_after_ten_polls)
    marks.begin()
    waited = turns.wait()
    assert ended == {"at": 10} and len(polls) == 10 and waited > 0
    marks.begin()  # the prompt's next pass starts at once
    assert turns.wait() > 0, "a new pass is waited for"
    assert turns.wait() == 0.0, "but only once: the step after it runs beside it"


def test_a_pass_is_never_waited_for_past_its_deadline(tmp_path):
    turns, marks, clock, _ = turns_and_marks(tmp_path)
    marks.begin()  # and never ends: its prefill died mid-pass
    started = clock.now
    turns.wait()
    assert MAX_TURN_S <= clock.now - started < MAX_TURN_S + 0.01
    assert turns.wait() == 0.0


def test_a_pass_is_waited_for_about_as_long_as_its_prefill_expects_it_to_take(tmp_path):
    """Its deadline is _TURN_SLACK times the expected duration, at least MIN_TURN_S: a pass
    that runs late past it is stepped beside; one expected to outlast MAX_TURN_S is waited
    for MAX_TURN_S."""
    turns, marks, clock, _ = turns_and_marks(tmp_path)
    for expected_s, waited_s in ((0.4, 0.6), (0.05, MIN_TURN_S)):
        marks.begin(expected_s=expected_s)  # and never ends
        started = clock.now
        turns.wait()
        assert waited_s <= clock.now - started < waited_s + 0.01
    marks.begin(expected_s=30.0)
    started = clock.now
    turns.wait()
    assert MAX_TURN_S <= clock.now - started < MAX_TURN_S + 0.01


def test_a_prefill_instance_that_left_is_forgotten(tmp_path):
    turns, marks, clock, _ = turns_and_marks(tmp_path)
    turns.wait()
    assert len(turns._maps) == 1
    marks.close()
    clock.now += 2.0  # past the rescan interval
    assert turns.wait() == 0.0 and turns._maps == {}
    turns.close()


def test_a_pass_takes_the_cores_once_the_passes_before_it_say_it_takes_prefill_takes_cores_ms():
    """Expected from the core-seconds per token measured so far: with 1 ms per token on one
    thread and 2 threads, 256 tokens take 128 ms (marked), 32 take 16 ms (not); nothing is
    marked before a pass was measured, nor with the setting at 0."""
    from pdchat.core.engine_api import EngineHooks
    from pdchat.core.generation.stage_engine import _PassTurns

    clock, taken, marks = Clock(), [], []

    class Threads:
        most = 2

        def before_pass(self):
            taken.append("idle cores")
            return 1

        def take_most(self):
            taken.append("most")
            return 2

        def after_most(self):
            taken.append("after most")

    hooks = EngineHooks(
        pass_began=lambda expected_s: marks.append(f"began {expected_s:.3f}") or True,
        pass_ended=lambda: marks.append("ended"),
    )
    turns = _PassTurns(Threads(), hooks, from_ms=40, clock=clock)

    def one_pass(tokens: int, seconds: float) -> None:
        turns.before(tokens)
        clock.now += seconds
        turns.after()

    one_pass(100, 0.1)  # unknown rate: beside decode; 1 ms of a core per token
    one_pass(256, 0.128)
    one_pass(32, 0.016)
    assert taken == ["idle cores", "most", "after most", "idle cores"]
    assert marks == ["began 0.128", "ended"], "256 tokens at 1 ms of a core each, on 2 cores"
    off = _PassTurns(Threads(), hooks, from_ms=0, clock=clock)
    for _ in range(2):
        off.before(4096)
        off.after()
    assert marks == ["began 0.128", "ended"]


def test_a_pass_is_marked_where_a_decode_in_use_waits_and_none_that_does_not_is_busy(tmp_path):
    """No decode, or a busy one that does not wait for marks (prefill_takes_cores_ms off on
    its server, decode_cpus): no mark. One that waits: marked while it holds sequences or held
    some in the last IN_USE_S (it may be handed a request during the pass); one never used (a
    P/D prefill server's own) or long idle: no mark."""
    clock = Clock()
    marks = PassMarks(tmp_path, clock=clock)
    assert marks.begin() is False, "no decode"
    load = LoadSlot(tmp_path, "decode_0_0", 4096, clock=clock)
    turns = PassTurns(tmp_path, clock=clock)
    assert marks.begin() is False, "a decode that waits, never used"
    load.set(1)
    assert marks.begin() is True
    clock.now += 1.0
    load.set(0)
    clock.now += IN_USE_S - 0.1
    assert marks.begin() is True, "idle, in use a moment ago"
    clock.now += 0.2
    assert marks.begin() is False, "idle for IN_USE_S"
    turns.close()
    load.set(1)
    assert marks.begin() is False, "a busy decode that does not wait keeps its cores"


def test_a_restarted_prefill_instances_new_file_is_read(tmp_path):
    turns, marks, clock, _ = turns_and_marks(tmp_path)
    turns.wait()
    marks.close()
    again = PassMarks(tmp_path, clock=clock)  # the same name, a new file
    clock.now += 2.0
    again.begin()
    assert turns.wait() > 0, "the new instance's pass is waited for"


def test_a_pd_pair_on_one_host_takes_turns_as_one_server(tmp_path):
    """The prefill server marks its passes for the decode server beside it (a live server of
    this host, on the same cores) once that decode waits for marks, and it waits for them; a
    gone server's files count for nothing."""
    import os

    from pdchat.ensemble.seal import server_id

    stage = tmp_path / "stage"
    prefill_server, decode_server = stage / server_id(os.getpid()), stage / server_id(os.getppid())
    gone_server = stage / f"{server_id(os.getpid()).split('-')[0]}-999999999-1"
    for directory in (prefill_server, decode_server, gone_server):
        directory.mkdir(parents=True)
    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.now += seconds

    LoadSlot(gone_server, "decode_0_0", 4096).set(5)
    (gone_server / f"decode-turns.{os.getpid()}").touch()  # it waited, once
    marks = PassMarks(prefill_server, clock=clock)
    assert marks.begin() is False, "no live decode waits"
    load = LoadSlot(decode_server, "decode_0_0", 4096)
    load.set(2)
    clock.now += 2.0  # past the rescan interval
    assert marks.begin() is False, "the decode server's decode does not wait for marks"
    turns = PassTurns(decode_server, clock=clock, sleep=sleep)
    assert marks.begin() is True
    assert turns.wait() >= MAX_TURN_S, "the decode server waits for the prefill server's pass"
    assert [path.parent for path in turns._maps] == [prefill_server]
    turns.close()


def test_one_step_waits_at_most_max_turn_s_for_all_the_prefills_on_its_cores(tmp_path):
    """Three prefill instances' passes that never end (each file is named by its process: here
    made by hand), one wait: MAX_TURN_S in all, not one per prefill."""
    import struct
    import subprocess

    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.now += seconds

    children = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        for child in children:
            (tmp_path / f"prefill-pass.{child.pid}").write_bytes(struct.pack("<qd", 1, clock.now + MAX_TURN_S))
        turns = PassTurns(tmp_path, clock=clock, sleep=sleep)
        assert MAX_TURN_S <= turns.wait() < MAX_TURN_S + 0.01
        turns.close()
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_prefill_that_dies_mid_pass_is_waited_for_no_more(tmp_path):
    """kill -9 of a prefill mid-pass leaves its mark running: decode stops waiting once it
    sees the process gone (within _ALIVE_POLL_S), not at the pass's deadline."""
    import struct
    import subprocess

    from pdchat.ensemble.core_turns import _ALIVE_POLL_S

    clock = Clock()
    prefill = subprocess.Popen(["sleep", "30"])
    (tmp_path / f"prefill-pass.{prefill.pid}").write_bytes(struct.pack("<qd", 1, clock.now + MAX_TURN_S))
    polls = []

    def sleep(seconds: float) -> None:
        clock.now += seconds
        polls.append(seconds)
        if len(polls) == 10:
            prefill.kill()
            prefill.wait()

    turns = PassTurns(tmp_path, clock=clock, sleep=sleep)
    try:
        assert 0 < turns.wait() <= 2 * _ALIVE_POLL_S < MAX_TURN_S
    finally:
        turns.close()
        prefill.kill()
        prefill.wait()


def test_a_dead_processs_files_count_for_nothing(tmp_path):
    """A decode stub killed with kill -9 leaves its decode-turns file and a busy load: no
    pass is marked for it; a prefill killed mid-pass leaves its mark: no decode waits for it."""
    import struct
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / f"decode-turns.{gone.pid}").touch()
    LoadSlot(tmp_path, "decode_0_0", 4096).set(3)
    marks = PassMarks(tmp_path)
    assert marks.begin() is False
    marks.close()
    clock = Clock()
    (tmp_path / f"prefill-pass.{gone.pid}").write_bytes(struct.pack("<qd", 1, clock.now + MAX_TURN_S))
    turns = PassTurns(tmp_path, clock=clock, sleep=lambda seconds: None)
    assert turns.wait() == 0.0 and turns._maps == {}
    turns.close()
