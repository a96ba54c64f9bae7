"""The supervisor's restart policy, on fake processes and a fake clock."""

import threading

import pytest

from pdchat.supervisor import RestartBudget, RestartPolicy, Supervisor

POLICY = RestartPolicy(
    first_delay_s=1, max_delay_s=30, max_restarts=5, window_s=600, start_timeout_s=60, progress_interval_s=30
)


class FakeChild:
    """A process that is running and ready until `die()`; `spawn` starts it again, ready
    once `comes_up_after` polls have passed (never if None)."""

    def __init__(self, name, comes_up_after=0):
        self.name = name
        self.comes_up_after = comes_up_after
        self.running, self.polls_to_ready = True, 0
        self.spawned = self.reaped = 0

    def die(self):
        self.running = False

    def exited(self):
        return not self.running

    def exit_report(self):
        return f"{self.name} was killed by SIGKILL"

    def reap(self):
        self.reaped += 1

    def spawn(self):
        self.spawned += 1
        self.running, self.polls_to_ready = True, self.comes_up_after

    def progress(self):
        return "loaded renderer; loading chat"

    def is_ready(self):
        if self.polls_to_ready is None:
            return False
        self.polls_to_ready -= 1
        return self.polls_to_ready < 0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def supervisor(children, clock, **options):
    said = []
    return Supervisor(children, POLICY, say=said.append, clock=clock, **options), said


def test_backoff_doubles_within_the_window_and_the_budget_is_five_restarts_in_it(clock):
    budget = RestartBudget(POLICY)
    assert [budget.grant(1000 + i) for i in range(6)] == [1, 2, 4, 8, 16, None]
    assert budget.grant(1000 + 599) is None, "the first restart is still within the window"
    assert budget.grant(1000 + 600) == 16, "the first restart has left the window"
    assert budget.grant(1000 + 2000) == 1, "a quiet window starts over"
    assert budget.total == 7


def test_the_delay_stops_doubling_at_its_maximum():
    budget = RestartBudget(RestartPolicy(first_delay_s=1, max_delay_s=30, max_restarts=10))
    assert [budget.grant(i) for i in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_dead_process_is_reaped_at_once_restarted_after_its_delay_and_reported_back(clock):
    prefill, decode = FakeChild("prefill", comes_up_after=1), FakeChild("decode")
    watcher, said = supervisor([prefill, decode], clock)
    assert watcher.poll() and said == []
    prefill.die()
    assert watcher.poll()
    assert prefill.reaped == 1 and prefill.spawned == 0
    assert said == [
        "prefill was killed by SIGKILL",
        "restarting prefill in 1 s: restart 1 (1 in the last 600 s, at most 5 in 600 s)",
    ]
    clock.now += 0.5
    assert watcher.poll() and prefill.spawned == 0
    clock.now += 0.5
    assert watcher.poll() and prefill.spawned == 1
    decode.die()  # seen while prefill is still coming up
    assert watcher.poll() and decode.reaped == 1
    assert watcher.poll() and said[-1] == "prefill is back (restart 1, ready 0 s after its start)"
    assert watcher.restarts() == {"prefill": 1, "decode": 1}


def test_one_failure_past_the_budget_gives_up(clock):
    prefill = FakeChild("prefill")
    watcher, said = supervisor([prefill], clock)
    for _ in range(POLICY.max_restarts):
        prefill.die()
        assert watcher.poll()
        clock.now += 30
        assert watcher.poll() and watcher.poll() and not prefill.exited()
    prefill.die()
    assert not watcher.poll()
    assert said[-1] == "prefill failed again after 5 restarts (at most 5 in 600 s): giving up"
    assert prefill.reaped == 5 and prefill.spawned == 5


def test_a_restart_that_never_gets_ready_counts_as_a_failure(clock):
    prefill = FakeChild("prefill", comes_up_after=None)
    watcher, said = supervisor([prefill], clock)
    prefill.die()
    watcher.poll()
    clock.now += 1
    watcher.poll()
    assert prefill.spawned == 1
    clock.now += POLICY.start_timeout_s
    assert watcher.poll()
    assert prefill.reaped == 2, "the hung process is killed before the next try"
    assert said[-2:] == [
        "prefill was not ready 60 s after its restart (loaded renderer; loading chat)",
        "restarting prefill in 2 s: restart 2 (2 in the last 600 s, at most 5 in 600 s)",
    ]


def test_a_restart_that_dies_while_starting_counts_as_a_failure(clock):
    prefill = FakeChild("prefill", comes_up_after=5)
    watcher, _ = supervisor([prefill], clock)
    prefill.die()
    watcher.poll()
    clock.now += 1
    watcher.poll()
    prefill.die()
    assert watcher.poll() and prefill.reaped == 2 and watcher.restarts() == {"prefill": 2}


def test_without_restarts_the_first_death_is_reported_and_ends_the_watch(clock):
    prefill = FakeChild("prefill")
    watcher, said = supervisor([prefill], clock, restart=False)
    prefill.die()
    assert not watcher.poll()
    assert said == ["prefill was killed by SIGKILL"] and prefill.reaped == prefill.spawned == 0


def test_run_returns_true_once_stopped_and_false_once_it_gives_up(clock):
    prefill = FakeChild("prefill")
    watcher, _ = supervisor([prefill], clock, restart=False)
    stop = threading.Event()
    stop.set()
    assert watcher.run(stop, interval_s=0)
    prefill.die()
    assert not watcher.run(threading.Event(), interval_s=0)


def test_a_restart_still_starting_is_logged_with_its_progress_every_interval(clock):
    prefill = FakeChild("prefill", comes_up_after=None)
    watcher, said = supervisor([prefill], clock)
    prefill.die()
    watcher.poll()
    clock.now += 1
    watcher.poll()  # spawned
    clock.now += POLICY.progress_interval_s - 1
    watcher.poll()
    assert not said[-1].startswith("prefill is not ready yet")
    clock.now += 1
    watcher.poll()
    assert said[-1] == "prefill is not ready yet, 30 s into restart 1 (up to 60 s): loaded renderer; loading chat"
    watcher.poll()
    assert said.count(said[-1]) == 1, "once per interval"


def test_a_servers_progress_is_read_from_its_log():
    from pdchat.launcher import model_progress

    log = "\n".join(
        [
            'I1201 model_lifecycle.cc:472] "loading: decode:1"',
            'I1201 model_lifecycle.cc:472] "loading: chat:1"',
            'I1201 model_lifecycle.cc:472] "loading: renderer:1"',
            "I1201 model_lifecycle.cc:839] \"successfully loaded 'renderer'\"",
            "E1201 model_lifecycle.cc:638] \"failed to load 'decode' version 1: Internal: ...\"",
        ]
    )
    assert model_progress(log) == "loaded renderer; loading chat; failed decode"
    assert model_progress("") == "no model loading yet"
