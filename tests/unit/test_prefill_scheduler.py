"""Prefill's scheduler: each pass to the prompt with the fewest passes left, so a short one
finishes before a long one sent first, and equal ones finish one after another; a failing
prompt fails alone and gives its blocks back; a pass takes along the prompts it completes
within its tokens, but not two that would compute the same first block."""

import threading

from pdchat.core.generation.prefill_scheduler import (
    STARVE_PASSES,
    PrefillLimits,
    PrefillScheduler,
    PrefillTask,
    fill_pass,
    next_turn,
)


class Chunks:
    """A prompt of `chunks` chunks; `log` records each chunk computed."""

    def __init__(self, name, chunks, log, fail_at=None, tokens=100, block=None):
        self.name, self.left, self.log, self.fail_at, self.abandoned = name, chunks, log, fail_at, False
        self.next_pass_tokens, self.block = tokens, block

    @property
    def passes_left(self):
        return self.left

    @property
    def uncached_block(self):
        return self.block

    def step(self):
        self.left -= 1
        self.log.append(self.name)
        if self.left == self.fail_at:
            raise RuntimeError(f"{self.name} broke")
        return f"{self.name}:done" if self.left == 0 else None

    def abandon(self):
        self.abandoned = True


def run(jobs, log):
    ended, all_done = [], threading.Event()

    def record(outcome):
        ended.append(outcome)
        if len(ended) == len(jobs):
            all_done.set()

    scheduler = PrefillScheduler()
    gate = threading.Event()
    scheduler.submit(PrefillTask(start=lambda: (gate.wait(), Chunks("z", 1, []))[1], done=lambda r: None, fail=print))
    for job in jobs:
        scheduler.submit(PrefillTask(start=lambda job=job: job, done=record, fail=lambda exc: record(str(exc))))
    gate.set()  # every task queued: they start together
    assert all_done.wait(10)
    scheduler.close()
    return ended


def test_a_short_prompt_finishes_first_and_a_failing_one_fails_alone():
    log = []
    long, broken, short = Chunks("long", 6, log), Chunks("broken", 4, log, fail_at=2), Chunks("short", 1, log)
    ended = run([long, broken, short], log)
    assert ended == ["short:done", "broken broke", "long:done"]
    assert log == ["short", "broken", "broken"] + ["long"] * 6, "fewest chunks left first"
    assert broken.abandoned and not long.abandoned and not short.abandoned


def test_equal_prompts_sent_at_once_finish_one_after_another_oldest_first():
    """Not all near the end, as taking turns by chunk finished them: the first one's first
    token comes after its own two chunks."""
    log = []
    ended = run([Chunks(name, 2, log) for name in "abc"], log)
    assert ended == ["a:done", "b:done", "c:done"] and log == ["a", "a", "b", "b", "c", "c"]


def test_a_prompt_passed_over_starve_passes_times_goes_next():
    assert next_turn([9, 1, 1], [0, 0, 0]) == 1, "fewest passes left, the oldest among equals"
    assert next_turn([9, 1], [STARVE_PASSES, 0]) == 0
    assert next_turn([9, 8, 1], [STARVE_PASSES + 2, STARVE_PASSES, 0]) == 0, "the oldest starved first"
    remaining, passed_over, served = [50, 1], [0, 0], []
    for _ in range(3 * (STARVE_PASSES + 1)):  # short prompts arrive without end
        turn = next_turn(remaining, passed_over)
        served.append(turn)
        passed_over = [0 if index == turn else passes + 1 for index, passes in enumerate(passed_over)]
    assert served.count(0) == 3, "the long prompt gets one pass in every STARVE_PASSES + 1"


def test_a_prompt_refused_at_start_does_not_stop_the_others():
    log = []

    def refused():
        raise ValueError("prompt too long")

    ended, done = [], threading.Event()
    scheduler = PrefillScheduler()
    scheduler.submit(PrefillTask(start=refused, done=ended.append, fail=lambda exc: ended.append(str(exc))))
    scheduler.submit(
        PrefillTask(start=lambda: Chunks("ok", 2, log), done=lambda r: (ended.append(r), done.set()), fail=print)
    )
    assert done.wait(10)
    scheduler.close()
    assert ended == ["prompt too long", "ok:done"]


def admitted(limits, jobs):
    """Run `jobs` ((name, tokens, chunks)) through a scheduler with `limits`; each outcome as
    it ends, and each prompt's first chunk in `log`."""
    log, ended, all_done = [], [], threading.Event()

    def record(outcome):
        ended.append(outcome)
        if len(ended) == len(jobs):
            all_done.set()

    scheduler = PrefillScheduler(limits=limits)
    for name, tokens, chunks in jobs:
        task = PrefillTask(
            start=lambda name=name, chunks=chunks: Chunks(name, chunks, log),
            done=record,
            fail=lambda exc: record(f"{type(exc).__name__}: {exc}"),
            tokens=tokens,
        )
        scheduler.submit(task)
    assert all_done.wait(10)
    scheduler.close()
    return ended, log


def test_a_prompt_starts_once_its_blocks_fit_beside_those_in_progress():
    """Prefill's pool had no admission: concurrent long prompts could exhaust it and fail
    midway. Now the second of two prompts that do not fit together waits for the first, and
    the prompts after it wait their turn (oldest first)."""
    limits = PrefillLimits(kv_blocks=10, block_tokens=16, max_wait_s=30)
    ended, log = admitted(limits, [("a", 100, 3), ("b", 100, 1), ("c", 10, 1)])  # 7 + 7 > 10
    assert ended == ["a:done", "b:done", "c:done"]
    assert log == ["a", "a", "a", "b", "c"], "b started only once a had ended"


def test_a_prompt_larger_than_the_pool_fails_at_once_and_one_that_waits_too_long_fails_naming_the_limit():
    limits = PrefillLimits(kv_blocks=10, block_tokens=16, max_wait_s=0.05)
    ended, _ = admitted(limits, [("huge", 200, 1)])
    assert ended == [
        "Unavailable: a prompt of 200 tokens needs 13 KV blocks, more than prefill's whole KV pool of 10 blocks (prefill_kv_mb)"
    ]

    class Slow(Chunks):
        def step(self):
            threading.Event().wait(0.05)
            return super().step()

    log, ended, both = [], [], threading.Event()
    scheduler = PrefillScheduler(limits=limits)
    for name, tokens, chunks in (("long", 150, 6), ("late", 100, 1)):
        scheduler.submit(
            PrefillTask(
                start=lambda name=name, chunks=chunks: Slow(name, chunks, log),
                done=lambda r: (ended.append(r), len(ended) == 2 and both.set()),
                fail=lambda exc: (ended.append(str(exc)), len(ended) == 2 and both.set()),
                tokens=tokens,
            )
        )
    assert both.wait(10)
    scheduler.close()
    assert ended[0].startswith("prefill's KV pool stayed full for 0.05 s") and "(prefill_kv_mb)" in ended[0]
    assert ended[1] == "long:done" and "late" not in log


def test_a_pass_takes_along_the_prompts_it_completes_within_its_tokens():
    # chosen: the fewest passes left; then, oldest first, one-pass prompts that fit
    assert fill_pass(2, [3, 1, 1, 1, 1], [100, 300, 100, 200, 50], [None] * 5, 400) == [2, 1]
    assert fill_pass(2, [3, 1, 1, 1, 1], [100, 350, 100, 200, 50], [None] * 5, 400) == [2, 3, 4]
    assert fill_pass(0, [3, 1, 2], [100, 100, 100], [None] * 3, 1000) == [0, 1], "the last needs two passes"
    assert fill_pass(0, [1, 1], [500, 1], [None] * 2, 500) == [0], "no room left"
    # one whose first block the pass already computes waits: the next pass finds it cached
    assert fill_pass(0, [1, 1, 1, 1], [100] * 4, [7, 7, None, 8], 1000) == [0, 2, 3]
    assert fill_pass(1, [1, 1, 1], [100] * 3, [5, 9, 9], 1000) == [1, 0]


def test_prompts_sent_together_are_computed_in_passes_of_several_and_a_failed_pass_fails_its_prompts():
    passes, ended, all_done = [], [], threading.Event()
    jobs = [
        Chunks("a", 1, [], tokens=300, block=1),
        Chunks("a2", 1, [], tokens=50, block=1),  # a's prefix: waits for the pass computing it
        Chunks("b", 1, [], tokens=50),
        Chunks("long", 3, [], tokens=400),
        Chunks("c", 1, [], tokens=60, fail_at=0),
        Chunks("d", 1, [], tokens=60),
    ]

    def compute(members):
        passes.append([job.name for job in members])
        if any(job.fail_at == 0 for job in members):
            raise RuntimeError("the pass broke")
        return [job.step() for job in members]

    def record(outcome):
        ended.append(outcome)
        if len(ended) == len(jobs):
            all_done.set()

    scheduler = PrefillScheduler(compute=compute, pass_tokens=400)
    gate = threading.Event()
    first = Chunks("z", 1, [], tokens=400)  # a pass of its own, while the others queue
    scheduler.submit(PrefillTask(start=lambda: (gate.wait(), first)[1], done=lambda r: None, fail=print))
    for job in jobs:
        scheduler.submit(PrefillTask(start=lambda job=job: job, done=record, fail=lambda exc: record(str(exc))))
    gate.set()
    assert all_done.wait(10)
    scheduler.close()
    assert passes == [["z"], ["a", "b"], ["a2", "c", "d"], ["long"], ["long"], ["long"]]
    assert ended == ["a:done", "b:done", "the pass broke", "the pass broke", "the pass broke", "long:done"]
    assert [job.abandoned for job in jobs] == [False, True, False, False, True, True]


def test_a_prompt_that_fails_after_its_pass_fails_alone():
    """compute() gives an exception as one member's outcome (its first token's choice, its
    KV's export failed): that prompt fails; the others of its pass end as they would."""
    ended, all_done = [], threading.Event()
    jobs = [Chunks(name, 1, [], tokens=50) for name in ("a", "b", "c")]

    def compute(members):
        return [ValueError(f"{job.name}'s KV") if job.name == "b" else job.step() for job in members]

    def record(outcome):
        ended.append(outcome if isinstance(outcome, str) else str(outcome))
        if len(ended) == len(jobs):
            all_done.set()

    scheduler = PrefillScheduler(compute=compute, pass_tokens=400)
    gate = threading.Event()
    first = Chunks("z", 1, [], tokens=400)
    scheduler.submit(PrefillTask(start=lambda: (gate.wait(), first)[1], done=lambda r: None, fail=print))
    for job in jobs:
        scheduler.submit(PrefillTask(start=lambda job=job: job, done=record, fail=record))
    gate.set()
    assert all_done.wait(10)
    scheduler.close()
    assert ended == ["a:done", "b's KV", "c:done"]
    assert [job.abandoned for job in jobs] == [False, True, False]
