"""Prefill's scheduler: one thread computes every prompt, a chunk at a time, in turn.

One prefill instance per server holds one KV pool, so its prefix cache serves every
request the server gets (two instances would each cache half the conversations). The
prompts in progress take turns by chunk (`chunk` tokens each), so a short prompt that
arrives while a long one prefills waits for at most one chunk of it, not its whole.

`submit()` from any thread; `done` and `fail` are called on the scheduler thread, once per
job, and should hand server calls to another thread (prefill's outbox).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Prefilling(Protocol):
    """What the scheduler needs of a prompt in progress (core.generation.generation.PrefillJob)."""

    def step(self) -> Any | None: ...

    def abandon(self) -> None: ...


@dataclass
class PrefillTask:
    start: Callable[[], Prefilling]  # builds the job (checks the prompt, takes its cached blocks)
    done: Callable[[Any], None]  # its result
    fail: Callable[[Exception], None]


class PrefillScheduler:
    """`before_pass`: called on the scheduler thread before each chunk's pass (prefill's
    PassThreads.before_pass: the torch threads it takes)."""

    def __init__(self, name: str = "pdchat-prefill", before_pass: Callable[[], object] | None = None):
        self._before_pass = before_pass
        self._incoming: queue.SimpleQueue[PrefillTask | None] = queue.SimpleQueue()
        self._turns: deque[tuple[PrefillTask, Prefilling]] = deque()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: PrefillTask) -> None:
        self._incoming.put(task)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the chunk in progress; jobs not finished fail."""
        self._incoming.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while self._take_incoming(block=not self._turns):
            task, job = self._turns.popleft()
            try:
                if self._before_pass is not None:
                    self._before_pass()
                result = job.step()
            except Exception as exc:  # noqa: BLE001 - every failure must reach its client
                job.abandon()
                task.fail(exc)
                continue
            if result is None:
                self._turns.append((task, job))  # its next chunk after the others' turns
            else:
                task.done(result)
        for task, job in self._turns:
            job.abandon()
            task.fail(RuntimeError("prefill is shutting down"))

    def _take_incoming(self, *, block: bool) -> bool:
        """Start the new tasks; False once close() was called."""
        while True:
            try:
                task = self._incoming.get(block=block)
            except queue.Empty:
                return True
            if task is None:
                return False
            block = False
            try:
                self._turns.append((task, task.start()))
            except Exception as exc:  # noqa: BLE001
                task.fail(exc)
                if not self._turns:
                    block = True
