"""ModelEventLoop: coroutines on one thread, blocking calls serialized, iterators read aside."""

import gc
import threading
import time

import pytest

from pdchat.triton import event_loop
from pdchat.triton.event_loop import ModelEventLoop


@pytest.fixture
def loop():
    instance = ModelEventLoop("test", max_concurrent=2)
    yield instance
    instance.close()


def test_coroutines_share_one_thread_and_blocking_calls_run_one_at_a_time(loop):
    threads, running, overlaps = set(), [0], []

    def blocking(i):
        running[0] += 1
        overlaps.append(running[0])
        time.sleep(0.01)
        running[0] -= 1
        return i * 10

    async def serve(i):
        threads.add(threading.current_thread().name)
        result = await loop.call_blocking("stage", blocking, i)
        threads.add(threading.current_thread().name)
        return result

    futures = [loop.submit(serve(i)) for i in range(6)]
    assert [f.result(5) for f in futures] == [0, 10, 20, 30, 40, 50]
    assert threads == {"test-loop"} and max(overlaps) == 1


def test_at_most_max_concurrent_coroutines_run_at_once(loop):
    active, peak = [0], [0]

    async def serve():
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await loop.call_blocking("stage", time.sleep, 0.01)
        active[0] -= 1

    for future in [loop.submit(serve()) for _ in range(6)]:
        future.result(5)
    assert peak[0] == 2


def test_lanes_run_side_by_side(loop):
    both_in = threading.Barrier(2, timeout=5)

    async def serve(lane):
        return await loop.call_blocking(lane, both_in.wait)

    futures = [loop.submit(serve("renderer")), loop.submit(serve("prefill"))]
    assert sorted(f.result(5) for f in futures) == [0, 1], "one lane waited for the other"


def test_iterate_yields_every_item_then_raises_the_iterators_error(loop):
    def items():
        yield from range(3)
        raise ValueError("stream broke")

    async def consume():
        seen = []
        try:
            async for item in loop.iterate(items):
                seen.append(item)
        except ValueError as exc:
            return seen, str(exc)

    assert loop.submit(consume()).result(5) == ([0, 1, 2], "stream broke")


def test_a_stream_slow_to_open_does_not_hold_the_loop(loop):
    """Decoupled BLS exec() returns with the called model's first response: it must not run on the loop."""
    opened = threading.Event()

    def slow_open():
        assert opened.wait(5)
        return iter([1])

    async def consume():
        return [item async for item in loop.iterate(slow_open)]

    async def meanwhile():
        return "served"

    stream = loop.submit(consume())
    assert loop.submit(meanwhile()).result(2) == "served"
    opened.set()
    assert stream.result(5) == [1]


def test_close_does_not_wait_for_a_stream_that_never_ends():
    loop = ModelEventLoop("stuck", max_concurrent=1)
    never, streaming = threading.Event(), threading.Event()

    async def serve():
        streaming.set()
        async for _ in loop.iterate(lambda: iter(never.wait, True)):
            pass

    loop.submit(serve())
    assert streaming.wait(5), "the stream never started"  # a coroutine never started warns when collected
    started = time.monotonic()
    loop.close(timeout=1)
    assert time.monotonic() - started < 3


def test_a_finished_stream_is_kept_a_while_then_released_on_the_loop_thread(loop, monkeypatch):
    """Triton's stub must not be the one to free a finished BLS stream (event_loop._retire)."""
    monkeypatch.setattr(event_loop, "RETIRE_S", 0.2)
    released_on = []

    class Stream:
        def __init__(self, count):
            self.items = iter(range(count))

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

        def __del__(self):
            released_on.append(threading.current_thread().name)

    async def consume(count):
        return [item async for item in loop.iterate(lambda: Stream(count))]

    assert loop.submit(consume(2)).result(5) == [0, 1]
    gc.collect()
    assert released_on == [], "dropped as soon as it ended"
    time.sleep(0.3)
    assert loop.submit(consume(1)).result(5) == [0]  # retiring the next one lets the old one go
    gc.collect()
    assert released_on == ["test-loop"]


def test_a_pooled_call_takes_a_free_lane_while_a_long_one_holds_the_other(loop):
    release, order = threading.Event(), []

    def long_call():
        release.wait(5)
        order.append("long")

    async def serve(name, function):
        await loop.call_pooled("stages", 2, function)
        return threading.current_thread().name

    held = loop.submit(serve("long", long_call))
    short = loop.submit(serve("short", lambda: order.append("short")))
    assert short.result(5) == "test-loop" and order == ["short"], "the short call waited for the long one"
    release.set()
    held.result(5)
    assert order == ["short", "long"]
