"""The decode scheduler batches requests, reports failures, honours cancellation and limits."""

import threading

from pdchat.core.generation.scheduler import DecodeJob, DecodeScheduler, Limits
from pdchat.core.output.responses import Delta


class CountingGeneration:
    """Emits `length` tokens named after the job, then finishes; `prefill_chunks` chunks first."""

    def __init__(self, name, length, fail_at=None, prefill_chunks=0):
        self.name, self.length, self.fail_at, self.step = name, length, fail_at, 0
        self.chunks_left, self.finished, self.cache, self.dropped = prefill_chunks, False, name, False

    @property
    def prefilling(self):
        return self.chunks_left > 0

    def prefill_step(self):
        self.chunks_left -= 1
        return self.chunks_left == 0

    @property
    def last_token_id(self):
        return self.step

    def emit(self):
        self.step += 1
        if self.step == self.fail_at:
            raise RuntimeError(f"{self.name} broke")
        self.finished = self.step == self.length
        return Delta(f"{self.name}{self.step}", [self.step], "length" if self.finished else None)

    greedy = False  # the batch's rows here are not tensors: no argmax over them

    def accept(self, logits, argmax=None):
        assert argmax is None
        assert logits == (self.name, self.step), "the batch handed this row another row's logits"

    def drop(self):
        self.dropped = True


class RecordingBatch:
    """Rows in join order; a step answers each row with (its cache name, its last token)."""

    def __init__(self):
        self.rows, self.steps = [], []

    def __len__(self):
        return len(self.rows)

    def join(self, cache):
        self.rows.append(cache)
        return len(self.rows) - 1

    def leave(self, rows):
        self.rows = [r for i, r in enumerate(self.rows) if i not in rows]

    def step_rows(self, token_ids, greedy):
        self.steps.append(list(self.rows))
        return list(zip(self.rows, token_ids, strict=True)), [None] * len(self.rows)

    def kv_bytes(self):
        return 100 * len(self.rows)


class Recorder:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def job(self, generation):
        def emit(delta):
            self.events.append(delta.text)
            if delta.finish_reason:
                self.events.append(f"{generation.name}:end")

        def fail(exc):
            self.events.append(f"error:{exc}")

        return DecodeJob(
            key=generation.name,
            start=lambda: generation,
            emit=emit,
            fail=fail,
            on_cancel=lambda: self.events.append(f"{generation.name}:cancelled"),
        )


def run_jobs(recorder, jobs, expected_events, batch=None, limits=None):
    scheduler = DecodeScheduler(RecordingBatch() if batch is None else batch, limits or Limits())
    gate = threading.Event()

    def held_start():
        gate.wait()
        return CountingGeneration("z", 1)

    # Hold the loop until every job is queued, so they start together.
    scheduler.submit(
        DecodeJob(key="z", start=held_start, emit=lambda d: None, fail=lambda e: None, on_cancel=lambda: None)
    )
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
    events = run_jobs(
        recorder, [recorder.job(CountingGeneration("a", 3, fail_at=2)), recorder.job(CountingGeneration("b", 2))], 5
    )
    assert events == ["a1", "b1", "error:a broke", "b2", "b:end"]


def test_a_request_whose_response_cannot_be_sent_fails_alone_and_the_scheduler_goes_on():
    recorder = Recorder()
    broken = recorder.job(CountingGeneration("a", 3))

    def emit(delta):
        if delta.text == "a2":
            raise RuntimeError("send failed")
        recorder.events.append(delta.text)

    broken = DecodeJob(key="a", start=broken.start, emit=emit, fail=broken.fail, on_cancel=broken.on_cancel)
    events = run_jobs(recorder, [broken, recorder.job(CountingGeneration("b", 3))], 6)
    assert events == ["a1", "b1", "error:send failed", "b2", "b3", "b:end"]


def test_start_failure_is_reported():
    recorder = Recorder()

    def broken_start():
        raise ValueError("bad kv")

    job = DecodeJob(
        key="x",
        start=broken_start,
        emit=lambda d: None,
        fail=lambda e: recorder.events.append(f"error:{e}"),
        on_cancel=lambda: None,
    )
    assert run_jobs(recorder, [job], 1) == ["error:bad kv"]


def test_cancel_by_key_closes_that_job_at_the_next_turn_and_only_it():
    recorder = Recorder()
    scheduler = DecodeScheduler(RecordingBatch())
    a = recorder.job(CountingGeneration("a", 50))
    emit = a.emit

    def emit_then_cancel(delta):
        emit(delta)
        if delta.text == "a2":
            scheduler.cancel("a")
            scheduler.cancel("no-such-job")

    a.emit = emit_then_cancel
    scheduler.submit(a)
    scheduler.submit(recorder.job(CountingGeneration("b", 4)))
    for _ in range(300):
        if "b:end" in recorder.events and "a:cancelled" in recorder.events:
            break
        threading.Event().wait(0.01)
    scheduler.close()
    assert [event for event in recorder.events if event.startswith("a")] == ["a1", "a2", "a:cancelled"]
    assert "b:end" in recorder.events


def test_a_cancel_that_came_just_before_its_job_still_cancels_it():
    """decode submits a job whose KV it pulled first, then cancels it if its caller left
    meanwhile: the scheduler may take the cancel a turn before the job."""
    recorder = Recorder()
    scheduler = DecodeScheduler(RecordingBatch())
    a = recorder.job(CountingGeneration("a", 6))
    late = recorder.job(CountingGeneration("c", 3))
    emit = a.emit

    def emit_and_race(delta):
        emit(delta)
        if delta.text == "a2":
            scheduler.cancel("c")  # taken next turn, before c is
        if delta.text == "a3":
            scheduler.submit(late)  # taken the turn after

    a.emit = emit_and_race
    scheduler.submit(a)
    close_after(scheduler, recorder, "a:end")
    assert "c:cancelled" in recorder.events and not any(event.startswith("c1") for event in recorder.events)


def test_running_requests_share_each_forward_pass_and_leave_when_done():
    recorder, batch = Recorder(), RecordingBatch()
    a, b = CountingGeneration("a", 3), CountingGeneration("b", 2)
    run_jobs(recorder, [recorder.job(a), recorder.job(b)], 7, batch)
    assert batch.steps == [["a", "b"], ["a"]]  # "z" (held start) finished first; b left after 2
    assert batch.rows == [] and not (a.dropped or b.dropped), "the batch, not the request, gave their KV back"


def test_a_local_prefill_is_chunked_between_the_others_steps():
    recorder, batch = Recorder(), RecordingBatch()
    long_prompt = CountingGeneration("p", 1, prefill_chunks=3)
    events = run_jobs(recorder, [recorder.job(CountingGeneration("a", 4)), recorder.job(long_prompt)], 7, batch)
    # a streams while p prefills (3 chunks), then p joins the batch.
    assert events[:3] == ["a1", "a2", "a3"] and events.index("p1") > events.index("a2")


def test_over_the_limits_requests_wait_then_get_unavailable_naming_the_limit():
    recorder = Recorder()
    clock = [0.0]
    limits = Limits(max_running=1, max_wait_s=5.0)
    a = recorder.job(CountingGeneration("a", 400))
    b = recorder.job(CountingGeneration("b", 1))
    original_emit = a.emit

    def emit(delta):
        original_emit(delta)
        clock[0] += 1.0  # each step of a takes a "second"

    a.emit = emit
    scheduler = DecodeScheduler(RecordingBatch(), limits, clock=lambda: clock[0])
    scheduler.submit(a)
    scheduler.submit(b)
    for _ in range(300):
        if any(e.startswith("error:") for e in recorder.events):
            break
        threading.Event().wait(0.01)
    scheduler.close()
    [error] = [e for e in recorder.events if e.startswith("error:")]
    assert "max_running=1" in error and "retry later" in error
    assert "b1" not in recorder.events


def test_a_request_bigger_than_the_whole_kv_budget_is_refused_at_once():
    recorder = Recorder()
    job = recorder.job(CountingGeneration("a", 2))
    job.tokens = 2000
    events = run_jobs(recorder, [job], 1, limits=Limits(kv_blocks=64, block_tokens=16))
    assert len(events) == 1 and "125 KV blocks" in events[0] and "whole KV pool of 64 blocks" in events[0]


def test_requests_wait_for_blocks_and_a_cancelled_local_prefill_gives_its_kv_back():
    recorder, batch = Recorder(), RecordingBatch()
    limits = Limits(kv_blocks=10, block_tokens=16)
    a, b = CountingGeneration("a", 3), CountingGeneration("b", 2, prefill_chunks=10**9)
    job_a, job_b = recorder.job(a), recorder.job(b)
    job_a.tokens = job_b.tokens = 16 * 6  # six blocks each: b waits until a left
    scheduler = DecodeScheduler(batch, limits)
    scheduler.submit(job_a)
    scheduler.submit(job_b)
    for _ in range(300):
        if "a3" in recorder.events and b.chunks_left < 10**9:
            break
        threading.Event().wait(0.01)
    scheduler.cancel(job_b.key)
    for _ in range(300):
        if b.dropped:
            break
        threading.Event().wait(0.01)
    scheduler.close()
    assert recorder.events.index("a3") < recorder.events.index("b:cancelled"), "b was admitted only once a left"
    assert b.dropped, "a request cancelled while prefilling gave its blocks back"


def owned_job(recorder, name, length, owner, blocks):
    job = recorder.job(CountingGeneration(name, length))
    job.owner, job.tokens = owner, 16 * blocks
    return job


def test_a_caller_past_its_share_of_the_kv_waits_for_its_own_requests_while_others_pass_it():
    """The red team's n=16: one caller's requests could reserve the whole pool. With half
    the pool per caller, its third request waits for its own first to end, and another
    caller's request, queued behind it, runs at once."""
    recorder = Recorder()
    limits = Limits(kv_blocks=12, block_tokens=16, owner_share=0.5)
    jobs = [
        owned_job(recorder, "a", 40, "greedy", 3),
        owned_job(recorder, "b", 40, "greedy", 3),
        owned_job(recorder, "c", 2, "greedy", 3),  # 9 > 6 blocks: waits for a or b
        owned_job(recorder, "d", 2, "other", 3),
    ]
    events = run_jobs(recorder, jobs, 2 * 40 + 2 * 3, limits=limits)
    assert events.index("d:end") < events.index("a:end"), "the other caller passed the waiting request"
    assert events.index("c1") > events.index("a:end"), "the caller's third request waited for its own"
    assert not [e for e in events if e.startswith("error:")]


def test_a_caller_with_nothing_reserved_is_admitted_past_its_share_while_the_pool_has_room():
    recorder = Recorder()
    limits = Limits(kv_blocks=12, block_tokens=16, owner_share=0.25)
    events = run_jobs(recorder, [owned_job(recorder, "a", 2, "big", 10)], 3, limits=limits)
    assert events == ["a1", "a2", "a:end"]


def test_a_request_waiting_on_its_callers_own_requests_does_not_expire():
    """The red team's n=16 whose choices together need more than the share: the later choices
    waited for the earlier ones past max_wait_s and failed. Waiting on its own caller is no
    wait for room: it runs once the caller's request before it ends, however long that takes."""
    recorder = Recorder()
    clock = [0.0]
    limits = Limits(kv_blocks=12, block_tokens=16, owner_share=0.5, max_wait_s=5.0)
    a, b = owned_job(recorder, "a", 30, "one", 6), owned_job(recorder, "b", 1, "one", 1)
    original_emit = a.emit

    def emit(delta):
        original_emit(delta)
        clock[0] += 1.0  # a's 30 steps take 30 "seconds", six times max_wait_s

    a.emit = emit
    scheduler = DecodeScheduler(RecordingBatch(), limits, clock=lambda: clock[0])
    scheduler.submit(a)
    scheduler.submit(b)
    for _ in range(300):
        if "b:end" in recorder.events:
            break
        threading.Event().wait(0.01)
    scheduler.close()
    assert not [e for e in recorder.events if e.startswith("error:")]
    assert recorder.events.index("a:end") < recorder.events.index("b1")


def test_a_caller_holds_at_most_its_share_of_the_batch_s_sequences():
    """The red team filled max_running with one tenant's small requests, within its KV share:
    the others got UNAVAILABLE naming max_running. A caller now holds at most its share of the
    sequences too; another caller's request passes its waiting ones."""
    recorder = Recorder()
    limits = Limits(max_running=4, kv_blocks=64, block_tokens=16, owner_share=0.5)
    jobs = [owned_job(recorder, name, 30, "many", 1) for name in "abc"] + [owned_job(recorder, "d", 2, "other", 1)]
    events = run_jobs(recorder, jobs, 3 * 31 + 3, limits=limits)
    assert events.index("d:end") < events.index("a:end")
    assert events.index("c1") > events.index("a:end"), "the caller's third request waited for its own"


def test_state_reports_are_spaced_while_running_and_the_idle_state_is_reported_at_once():
    """A state that changes every step is reported at most once per interval; the state the
    scheduler goes idle in is reported at once, so gauges never stay at a running count."""
    recorder, states = Recorder(), []
    ticks = iter(range(10_000))  # a clock that advances 1 "second" per reading

    class GrowingBatch(RecordingBatch):
        def kv_bytes(self):  # every step holds more, as rows' blocks fill
            return 100 * len(self.steps) if self.rows else 0

    scheduler = DecodeScheduler(
        GrowingBatch(), Limits(), on_state=states.append, state_interval_s=3.0, clock=lambda: next(ticks)
    )
    scheduler.submit(recorder.job(CountingGeneration("a", 12)))
    for _ in range(200):
        if "a:end" in recorder.events:
            break
        threading.Event().wait(0.01)
    for _ in range(200):
        if states and states[-1].running == 0:
            break
        threading.Event().wait(0.01)
    scheduler.close()
    assert "a:end" in recorder.events
    assert states[-1].running == 0 and states[-1].kv_bytes == 0, "the idle state was never reported"
    running = [s for s in states if s.running]
    # 12 steps, the KV changing every step: far fewer reports than steps.
    assert 1 <= len(running) <= 6, states


def close_after(scheduler: DecodeScheduler, recorder: Recorder, event: str) -> None:
    """Close `scheduler` once `event` is recorded (or 2 s passed) and its last pass published."""
    for _ in range(200):
        if event in recorder.events:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.05)
    scheduler.close()


def test_the_sequences_held_are_published_as_they_come_and_go():
    loads, recorder = [], Recorder()
    scheduler = DecodeScheduler(RecordingBatch(), on_load=lambda held, queued: loads.append(held))
    gate = threading.Event()

    def held_start():
        gate.wait()
        return CountingGeneration("a", 3)

    scheduler.submit(
        DecodeJob(
            key="a",
            start=held_start,
            emit=recorder.job(CountingGeneration("a", 3)).emit,
            fail=lambda e: None,
            on_cancel=lambda: None,
        )
    )
    for _ in range(100):  # the job is queued, its start held
        if loads and loads[-1] == 1:
            break
        threading.Event().wait(0.01)
    assert loads[-1] == 1, "a job taken in but not yet started counts"
    gate.set()
    close_after(scheduler, recorder, "a:end")
    assert loads[-1] == 0, "the scheduler went idle without publishing it"
    assert loads[0] == 1 and set(loads) == {0, 1}


def test_jobs_left_queued_at_the_limits_are_published_as_queued():
    """What chat reads before it sends a first output ahead of decode (DecodeLoad.has_room)."""
    loads, recorder = [], Recorder()
    scheduler = DecodeScheduler(RecordingBatch(), Limits(max_running=1), on_load=lambda *counts: loads.append(counts))
    for name in ("a", "b"):
        scheduler.submit(recorder.job(CountingGeneration(name, 3)))
    close_after(scheduler, recorder, "b:end")
    assert (2, 1) in loads, "b waiting for a's row was not published as queued"
    assert loads[-1] == (0, 0)


def test_a_job_that_comes_and_goes_between_two_reports_gets_the_idle_state_reported_again():
    """The idle state after a job is reported even when it equals the last one reported
    (on_state reads the pool's counters beside it, which the job moved)."""
    recorder, states = Recorder(), []
    scheduler = DecodeScheduler(RecordingBatch(), Limits(), on_state=states.append, state_interval_s=3600.0)
    for name in ("a", "b"):
        scheduler.submit(recorder.job(CountingGeneration(name, 2)))
        for _ in range(200):
            if f"{name}:end" in recorder.events and states and states[-1].running == 0:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.05)
    scheduler.close()
    idle = [s for s in states if s.running == 0 and s.waiting == 0]
    assert len(idle) == 2, states


def wait_until(condition, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        threading.Event().wait(0.01)
    return False


def test_a_local_prefill_takes_the_idle_cores_only_while_no_row_runs_and_steps_keep_the_base():
    from pdchat.core.generation.pass_threads import PassThreads

    threads = [1]  # what the engine's passes run on now
    seen = []  # (what ran, on how many threads)

    class Watched(CountingGeneration):
        def prefill_step(self):
            seen.append((f"{self.name} chunk", threads[0]))
            return super().prefill_step()

    class WatchedBatch(RecordingBatch):
        def step_rows(self, token_ids, greedy):
            seen.append(("step", threads[0]))
            return super().step_rows(token_ids, greedy)

    class OneCoreIdle:
        def since_last(self):
            return 1.0

    pass_threads = PassThreads(1, 2, OneCoreIdle(), lambda n: threads.__setitem__(0, n), min_window_s=0)
    scheduler = DecodeScheduler(WatchedBatch(), Limits(), pass_threads=pass_threads)
    recorder = Recorder()
    try:
        scheduler.submit(recorder.job(Watched("p", 3, prefill_chunks=2)))  # alone
        assert wait_until(lambda: "p:end" in recorder.events)
        gate = threading.Event()
        running = CountingGeneration("a", 50)

        def held_start():  # the loop waits here until q is queued too
            gate.wait()
            return running

        scheduler.submit(DecodeJob("a", held_start, lambda d: None, lambda e: None, lambda: None))
        scheduler.submit(recorder.job(Watched("q", 2, prefill_chunks=2)))
        gate.set()
        assert wait_until(lambda: "q:end" in recorder.events and running.finished)
    finally:
        scheduler.close()
    assert seen[:2] == [("p chunk", 2), ("p chunk", 2)], "a lone prompt's chunks take the idle core"
    assert [n for name, n in seen if name == "q chunk"] == [1, 1], "a chunk beside a running row keeps the base"
    assert {n for name, n in seen if name == "step"} == {1}, "every decode step keeps the base"
