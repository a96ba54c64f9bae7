"""Decode many requests on one thread, a token each in turn.

Interleaving keeps a new request's first token from waiting behind a long answer,
and one thread owns the model, so no two requests race on it. (Batching the steps
into one forward pass is the next step for throughput.)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdchat.core.generation import Generation
from pdchat.core.responses import Delta

log = logging.getLogger(__name__)


@dataclass
class DecodeJob:
    """A request to decode, with the callbacks that reach its client."""

    key: str  # unique per request (GenerationParams.request_id): what cancel() names
    start: Callable[[], Generation]  # builds the decode state (KV import or local prefill)
    emit: Callable[[Delta], None]  # called per token; the last delta has a finish_reason
    fail: Callable[[Exception], None]  # the request ends with this error
    is_cancelled: Callable[[], bool]
    on_cancel: Callable[[], None]  # the client went away: close the stream, drop the state


class DecodeScheduler:
    def __init__(self, name: str = "pdchat-decode"):
        self._incoming: queue.SimpleQueue[DecodeJob | Callable[[], None] | None] = queue.SimpleQueue()
        self._active: list[tuple[DecodeJob, Generation]] = []
        self._cancel_requests: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: DecodeJob) -> None:
        self._incoming.put(job)

    def post(self, call: Callable[[], None]) -> None:
        """Run `call` on the scheduler thread between steps: for answers that must not
        come from another thread (in Triton, every send of a model from one thread)."""
        self._incoming.put(call)

    def cancel(self, key: str) -> None:
        """Stop the job with this key (from any thread): for callers whose own client left
        but whose cancellation Triton does not pass on (BLS and ensembles in 2.51)."""
        self._cancel_requests.put(key)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after cancelling whatever is still running."""
        self._incoming.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            if not self._take_incoming(block=not self._active):
                break
            cancelled = self._cancelled_keys()
            for entry in list(self._active):
                self._step(*entry, cancelled=entry[0].key in cancelled)
        for job, _ in self._active:
            job.on_cancel()
        self._active.clear()

    def _take_incoming(self, *, block: bool) -> bool:
        """Start queued jobs; False once close() was called."""
        while True:
            try:
                job = self._incoming.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            block = False
            if not isinstance(job, DecodeJob):
                try:
                    job()
                except Exception:  # noqa: BLE001 - a posted call's failure is its own
                    log.exception("posted call failed")
                continue
            try:
                self._active.append((job, job.start()))
            except Exception as exc:  # noqa: BLE001 - every failure must reach its client
                job.fail(exc)

    def _cancelled_keys(self) -> set[str]:
        """Keys cancel() named since the last turn; those matching no active job are dropped."""
        keys = set()
        while True:
            try:
                keys.add(self._cancel_requests.get_nowait())
            except queue.Empty:
                return keys

    def _step(self, job: DecodeJob, generation: Generation, *, cancelled: bool) -> None:
        try:
            if cancelled or job.is_cancelled():
                self._active.remove((job, generation))
                job.on_cancel()
                return
            delta = generation.advance()
        except Exception as exc:  # noqa: BLE001
            log.exception("decode step failed")
            self._active.remove((job, generation))
            job.fail(exc)
            return
        if delta.finish_reason:
            self._active.remove((job, generation))
        job.emit(delta)
