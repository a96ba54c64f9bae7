"""The HTTP front takes a stream's outputs on its event loop as they arrive, and anything
that may block (the stream's end, an error, a long silence) on a worker thread."""

import asyncio
import threading

from pdchat.clients import http_routes
from pdchat.clients.chat import Waiting

LOOP_THREAD = threading.current_thread().name  # asyncio.run runs the loop on this thread


class Streams:
    """A stand-in RequestStreams: `waiting` is the test's to set."""

    def __init__(self, waiting=lambda: Waiting.NOTHING):
        self.waiting = waiting
        self.on_arrival = None


async def in_thread(func, *args):
    return await asyncio.to_thread(func, *args)


def arrivals_of(count: int, streams: Streams) -> tuple[http_routes._Arrivals, list[str]]:
    """_Arrivals over outputs 0..count-1 (on the running loop), and the threads that took each."""
    threads: list[str] = []

    def outputs():
        for i in range(count):
            threads.append(threading.current_thread().name)
            yield i

    return http_routes._Arrivals(outputs(), streams, in_thread), threads


def test_an_output_already_here_is_taken_on_the_loop():
    async def main():
        arrivals, threads = arrivals_of(3, Streams(lambda: Waiting.OUTPUT))
        assert [await arrivals.next() for _ in range(3)] == [0, 1, 2]
        return threads

    assert asyncio.run(main()) == [LOOP_THREAD] * 3


def test_what_may_block_is_taken_by_a_worker_thread_at_once():
    async def main():
        arrivals, threads = arrivals_of(1, Streams(lambda: Waiting.OTHER))
        started = asyncio.get_running_loop().time()
        assert await arrivals.next() == 0
        assert await arrivals.next() is None
        return threads, asyncio.get_running_loop().time() - started

    threads, seconds = asyncio.run(main())
    assert threads and threads[0] != LOOP_THREAD
    assert seconds < http_routes.ARRIVAL_WAIT_S  # no wait for an arrival that cannot come


def test_an_arrival_wakes_the_waiting_loop():
    async def main():
        state = {"now": Waiting.NOTHING}
        streams = Streams(lambda: state["now"])
        arrivals, threads = arrivals_of(1, streams)

        def arrive():  # as a stream's reader thread does
            state["now"] = Waiting.OUTPUT
            streams.on_arrival()

        asyncio.get_running_loop().call_later(0.05, threading.Thread(target=arrive).start)
        assert await arrivals.next() == 0
        return threads

    assert asyncio.run(main()) == [LOOP_THREAD]


def test_a_silence_past_the_wait_goes_to_a_worker_thread(monkeypatch):
    monkeypatch.setattr(http_routes, "ARRIVAL_WAIT_S", 0.05)

    async def main():
        arrivals, threads = arrivals_of(1, Streams())  # the worker's `next` waits for the stream itself
        return await arrivals.next(), threads

    output, threads = asyncio.run(main())
    assert output == 0 and threads[0] != LOOP_THREAD


def test_an_arrival_after_the_loop_closed_is_dropped():
    streams = Streams()

    async def main():
        arrivals_of(0, streams)

    asyncio.run(main())
    streams.on_arrival()  # the loop is closed: nothing raises on the reader thread
