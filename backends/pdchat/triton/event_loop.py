"""One event loop per model process: the only thread that calls into the python backend.

Triton 2.51's python backend is not safe against every call overlapping with itself
from several threads of one model (docs/notes/python-backend-concurrency.md). A model
built on `ModelEventLoop` serves each request as a coroutine on one loop thread, so its
sends, cancellation checks, logs and metric updates never overlap; what blocks runs
elsewhere and only hands results back to the loop:

- `call_blocking`: a blocking call (a BLS `exec()` to another model), one at a time per
  lane (a worker thread per lane), in arrival order; `call_pooled` picks the least busy
  of a pool's lanes (as many as the called models have instances);
- `iterate`: a blocking iterator (a decoupled BLS response stream), opened and read by a
  thread of its own that only waits for the next item. Once it is done, the loop keeps it
  for `RETIRE_S` before letting it go (see `_retire`).

All threads are daemons: a stub asked to stop never waits for a stream that cannot end.
No Triton import here, so it is tested without a server.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()
# How long a finished BLS response stream is kept alive (see ModelEventLoop._retire).
RETIRE_S = 5.0


class ModelEventLoop:
    def __init__(self, name: str, max_concurrent: int):
        self.loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(max_concurrent)  # bound to the loop on first use
        self._lanes: dict[str, queue.SimpleQueue[tuple[Callable[[], Any], Future] | None]] = {}
        self._busy: collections.Counter[str] = collections.Counter()  # calls queued or running per lane
        self._retired: collections.deque[tuple[float, Iterator[Any]]] = collections.deque()  # loop thread only
        self._name = name
        self._threads = [threading.Thread(target=self.loop.run_forever, name=f"{name}-loop", daemon=True)]
        self._threads[0].start()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> Future:
        """Run `coroutine` on the loop once one of `max_concurrent` slots is free (from any thread)."""
        return asyncio.run_coroutine_threadsafe(self._in_slot(coroutine), self.loop)

    async def call_blocking(self, lane: str, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on `lane`'s worker thread, after the calls queued there before it."""
        if lane not in self._lanes:  # (only the loop thread gets here: no race)
            self._lanes[lane] = queue.SimpleQueue()
            thread = threading.Thread(
                target=_run_calls, args=(self._lanes[lane],), name=f"{self._name}-{lane}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        future: Future = Future()
        self._lanes[lane].put((lambda: function(*args), future))
        return await asyncio.wrap_future(future)

    async def call_pooled(self, pool: str, lanes: int, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on whichever of `pool`'s `lanes` lanes has the fewest calls
        queued or running (the first, on a tie): one long call holds one lane, not all."""
        lane = min((f"{pool}-{index}" for index in range(lanes)), key=lambda name: self._busy[name])
        self._busy[lane] += 1
        try:
            return await self.call_blocking(lane, function, *args)
        finally:
            self._busy[lane] -= 1

    async def iterate(self, open_items: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
        """The items of the blocking iterator `open_items()` returns, opened and read on a
        thread of its own.

        NOTE: opening runs there too: Triton's decoupled BLS `exec()` returns only once the
        called model sent its first response, which may take as long as that model likes."""
        arrived: asyncio.Queue = asyncio.Queue()
        loop = self.loop

        def read() -> None:
            items: Iterator[T] | None = None
            try:
                items = open_items()
                for item in items:
                    loop.call_soon_threadsafe(arrived.put_nowait, item)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                loop.call_soon_threadsafe(arrived.put_nowait, exc)
            if items is not None:
                loop.call_soon_threadsafe(self._retire, items)
            loop.call_soon_threadsafe(arrived.put_nowait, _END)

        threading.Thread(target=read, name=f"{self._name}-read", daemon=True).start()
        while (item := await arrived.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and the workers within `timeout` in all; coroutines still running
        are abandoned (their threads are daemons)."""
        for calls in self._lanes.values():
            calls.put(None)
        self.loop.call_soon_threadsafe(self.loop.stop)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _retire(self, items: Iterator[Any]) -> None:
        """Hold a finished stream for RETIRE_S, then drop it on this thread.

        Why: in Triton 2.51's stub a decoupled BLS stream (`ResponseIterator`, holding
        every response it yielded) is also held by the stub's own map, which its cleanup
        thread empties without the GIL once the stream is done. If that map held the last
        reference, the stream's tensors free their numpy arrays there, without the GIL,
        racing every Python thread's allocator: the heap corruption `chat` died of under
        load (python_backend r25.01 takes the GIL there). Letting go of the stream only
        well after the stub's cleanup makes Python's reference the last one, so it is
        freed here, under the GIL."""
        now = time.monotonic()
        self._retired.append((now, items))
        while self._retired and now - self._retired[0][0] > RETIRE_S:
            self._retired.popleft()

    async def _in_slot(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        async with self._slots:
            return await coroutine


def _run_calls(calls: queue.SimpleQueue) -> None:
    while (call := calls.get()) is not None:
        function, future = call
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(function())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(exc)
