"""Prefill's scheduler: prompts take turns by chunk, so a short one finishes before a long
one sent first; a failing prompt fails alone and gives its blocks back."""

import threading

from pdchat.core.generation.prefill_scheduler import PrefillScheduler, PrefillTask


class Chunks:
    """A prompt of `chunks` chunks; `log` records each chunk computed."""

    def __init__(self, name, chunks, log, fail_at=None):
        self.name, self.left, self.log, self.fail_at, self.abandoned = name, chunks, log, fail_at, False

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
    assert log[:3] == ["long", "broken", "short"], "one chunk each, in turn"
    assert broken.abandoned and not long.abandoned and not short.abandoned


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
