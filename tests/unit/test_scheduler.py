"""The decode scheduler interleaves requests, reports failures and honours cancellation."""

import threading

from pdchat.core.responses import Delta
from pdchat.core.scheduler import DecodeJob, DecodeScheduler


class CountingGeneration:
    """Emits `length` tokens named after the job, then finishes."""

    def __init__(self, name, length, fail_at=None):
        self.name, self.length, self.fail_at, self.step = name, length, fail_at, 0

    def advance(self):
        self.step += 1
        if self.step == self.fail_at:
            raise RuntimeError(f"{self.name} broke")
        return Delta(f"{self.name}{self.step}", [self.step], "length" if self.step == self.length else None)


class Recorder:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def job(self, generation, *, cancelled=lambda: False, expect_end=True):
        def emit(delta):
            self.events.append(delta.text)
            if delta.finish_reason:
                self.events.append(f"{generation.name}:end")

        def fail(exc):
            self.events.append(f"error:{exc}")

        return DecodeJob(
            key=generation.name,
            start=lambda: generation, emit=emit, fail=fail, is_cancelled=cancelled,
            on_cancel=lambda: self.events.append(f"{generation.name}:cancelled"),
        )


def run_jobs(recorder, jobs, expected_events):
    scheduler = DecodeScheduler()
    gate = threading.Event()

    def held_start():
        gate.wait()
        return CountingGeneration("z", 1)

    # Hold the loop until every job is queued, so they start together.
    scheduler.submit(DecodeJob(key="z", start=held_start, emit=lambda d: None,
                               fail=lambda e: None, is_cancelled=lambda: False, on_cancel=lambda: None))
    for job in jobs:
        scheduler.submit(job)
    gate.set()
    for _ in range(200):
        if len(recorder.events) >= expected_events:
            break
        threading.Event().wait(0.01)
    scheduler.close()
    return recorder.events


def test_requests_take_turns():
    recorder = Recorder()
    events = run_jobs(recorder, [recorder.job(CountingGeneration("a", 3)), recorder.job(CountingGeneration("b", 2))], 7)
    assert events == ["a1", "b1", "a2", "b2", "b:end", "a3", "a:end"]


def test_a_failing_request_gets_its_error_and_others_go_on():
    recorder = Recorder()
    events = run_jobs(recorder, [recorder.job(CountingGeneration("a", 3, fail_at=2)), recorder.job(CountingGeneration("b", 2))], 5)
    assert events == ["a1", "b1", "error:a broke", "b2", "b:end"]


def test_cancelled_request_is_closed_and_dropped():
    recorder = Recorder()
    steps = {"n": 0}

    def cancelled():
        steps["n"] += 1
        return steps["n"] > 2

    events = run_jobs(recorder, [recorder.job(CountingGeneration("a", 10), cancelled=cancelled)], 3)
    assert events == ["a1", "a2", "a:cancelled"]


def test_start_failure_is_reported():
    recorder = Recorder()

    def broken_start():
        raise ValueError("bad kv")

    job = DecodeJob(key="x", start=broken_start, emit=lambda d: None, fail=lambda e: recorder.events.append(f"error:{e}"),
                    is_cancelled=lambda: False, on_cancel=lambda: None)
    assert run_jobs(recorder, [job], 1) == ["error:bad kv"]


def test_cancel_by_key_stops_that_job_only():
    recorder = Recorder()
    scheduler = DecodeScheduler()
    seen_a1 = threading.Event()
    a = recorder.job(CountingGeneration("a", 50))
    original_emit = a.emit

    def emit(delta):
        original_emit(delta)
        if delta.text == "a1":
            scheduler.cancel("a")
            scheduler.cancel("no-such-job")
            seen_a1.set()

    a.emit = emit
    scheduler.submit(a)
    scheduler.submit(recorder.job(CountingGeneration("b", 4)))
    for _ in range(300):
        if "b:end" in recorder.events and "a:cancelled" in recorder.events:
            break
        threading.Event().wait(0.01)
    scheduler.close()
    assert seen_a1.is_set()
    assert "a:cancelled" in recorder.events and "a3" not in recorder.events
    assert "b:end" in recorder.events
