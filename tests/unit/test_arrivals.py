"""The HTTP front takes a stream's outputs on its event loop as they arrive, and anything
that may block (the stream's end, an error, a long silence) on a worker thread."""

import asyncio
import threading

from pdchat.clients import openai_api
from pdchat.clients.chat import Waiting


class Streams:
    """A stand-in RequestStreams: `waiting` is the test's to set."""

    def __init__(self):
        self.waiting = lambda: Waiting.NOTHING
        self.on_arrival = None


def recording(threads: list[str], count: int):
    for i in range(count):
        threads.append(threading.current_thread().name)
        yield i


async def in_thread(func, *args):
    return await asyncio.to_thread(func, *args)


def run(coroutine):
    return asyncio.run(coroutine)


def test_an_output_already_here_is_taken_on_the_loop():
    async def main():
        threads: list[str] = []
        streams = Streams()
        streams.waiting = lambda: Waiting.OUTPUT
        arrivals = openai_api._Arrivals(recording(threads, 3), streams, in_thread)
        assert [await arrivals.next() for _ in range(3)] == [0, 1, 2]
        return threads

    assert run(main()) == [threading.current_thread().name] * 3


def test_what_may_block_is_taken_by_a_worker_thread_at_once():
    async def main():
        threads: list[str] = []
        streams = Streams()
        streams.waiting = lambda: Waiting.OTHER
        arrivals = openai_api._Arrivals(recording(threads, 1), streams, in_thread)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await arrivals.next() == 0
        assert await arrivals.next() is None
        return threads, loop.time() - started

    threads, seconds = run(main())
    assert threads and threads[0] != threading.current_thread().name
    assert seconds < openai_api.ARRIVAL_WAIT_S  # no wait for an arrival that cannot come


def test_an_arrival_wakes_the_waiting_loop():
    async def main():
        threads: list[str] = []
        streams = Streams()
        state = {"now": Waiting.NOTHING}
        streams.waiting = lambda: state["now"]
        arrivals = openai_api._Arrivals(recording(threads, 1), streams, in_thread)

        def arrive():  # as a stream's reader thread does
            state["now"] = Waiting.OUTPUT
            streams.on_arrival()

        asyncio.get_running_loop().call_later(0.05, threading.Thread(target=arrive).start)
        assert await arrivals.next() == 0
        return threads

    assert run(main()) == [threading.current_thread().name]


def test_a_silence_past_the_wait_goes_to_a_worker_thread(monkeypatch):
    monkeypatch.setattr(openai_api, "ARRIVAL_WAIT_S", 0.05)

    async def main():
        threads: list[str] = []
        streams = Streams()
        streams.waiting = lambda: Waiting.NOTHING  # the worker's `next` waits for the stream itself
        arrivals = openai_api._Arrivals(recording(threads, 1), streams, in_thread)
        return await arrivals.next(), threads

    output, threads = run(main())
    assert output == 0 and threads[0] != threading.current_thread().name


def test_an_arrival_after_the_loop_closed_is_dropped():
    streams = Streams()

    async def main():
        return openai_api._Arrivals(iter(()), streams, in_thread)

    run(main())
    streams.on_arrival()  # the loop is closed: nothing raises on the reader thread
