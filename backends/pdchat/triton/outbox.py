"""A model's one thread for calls into the server process, run in order beside its work.

decode's scheduler thread owns the model; what it has to say to the server (every
response, error and cancel acknowledgement, every metric update) it hands to the
`Outbox`, whose thread makes those calls while the scheduler runs the next forward pass.
Sending a batch's responses costs about as much as a third of a forward pass on the tiny
model (one IPC round trip each), so doing it in turn with the forward pass was a third
of every step at concurrency 16; beside it, the step is the forward pass.

The outbox is also where each stream's client is asked whether it left
(`is_cancelled()` is a round trip to the server too): streams being `watch`ed are polled
every `poll_s`, and the first that says yes gets its `on_cancelled` called, once.

One thread, as for `chat` (pdchat.triton.event_loop): Triton 2.51's python backend is
not safe against all its calls overlapping from several threads of one model. The queue
is bounded, so a producer faster than the server waits instead of piling up responses
(at most about one step's worth ahead): `call`. `post` never waits, for `execute()`: a
model's execute() blocked on a full outbox, while the outbox thread sent a response, left
a decode stub deadlocked under a soak (its send never returned; Triton's python backend
is not shown to send while execute() blocks). No Triton import here: tested without a server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)
_STOP = object()


class Outbox:
    def __init__(self, name: str, *, max_pending: int = 64, poll_s: float = 0.05):
        self._calls: deque[Callable[[], None] | object] = deque()
        self._changed = threading.Condition()
        self._max_pending, self._poll_s = max_pending, poll_s
        self._watched: dict[Hashable, tuple[Callable[[], bool], Callable[[], None]]] = {}  # outbox thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, function: Callable[[], None]) -> None:
        """Run `function()` on the outbox thread, after everything handed over before it
        (from any thread; waits while `max_pending` calls are queued)."""
        with self._changed:
            while len(self._calls) >= self._max_pending:
                self._changed.wait()
            self._calls.append(function)
            self._changed.notify_all()

    def post(self, function: Callable[[], None]) -> None:
        """`call`, never waiting for room: from a model's execute() (module docstring)."""
        with self._changed:
            self._calls.append(function)
            self._changed.notify_all()

    def watch(self, key: Hashable, is_cancelled: Callable[[], bool], on_cancelled: Callable[[], None]) -> None:
        """Poll `is_cancelled()` every `poll_s` until it says yes (then `on_cancelled()`) or
        `unwatch(key)`; in order with the calls around it (on the outbox thread: at once)."""
        if threading.current_thread() is self._thread:
            self._watched[key] = (is_cancelled, on_cancelled)
        else:
            self.post(lambda: self._watched.__setitem__(key, (is_cancelled, on_cancelled)))

    def unwatch(self, key: Hashable) -> None:
        """Stop polling `key`. On the outbox thread (inside a call) it takes effect at once."""
        if threading.current_thread() is self._thread:
            self._watched.pop(key, None)
        else:
            self.post(lambda: self._watched.pop(key, None))

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop (within `timeout`: the thread is a daemon)."""
        self.post(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        polled_at = time.monotonic()
        while True:
            with self._changed:
                if not self._calls:
                    self._changed.wait(self._poll_s)
                function = self._calls.popleft() if self._calls else None  # None: on to the poll
                self._changed.notify_all()
            if function is _STOP:
                return
            if function is not None:
                try:
                    function()
                except Exception:  # noqa: BLE001 - one call's failure is its caller's, not the outbox's
                    log.exception("outbox call failed")
            if time.monotonic() - polled_at >= self._poll_s:
                self._poll()
                polled_at = time.monotonic()

    def _poll(self) -> None:
        for key, (is_cancelled, on_cancelled) in list(self._watched.items()):
            try:
                cancelled = is_cancelled()
            except Exception:  # noqa: BLE001 - a stream that cannot be asked is taken as gone
                log.exception("cancellation check failed for %s", key)
                cancelled = True
            if cancelled:
                del self._watched[key]
                try:
                    on_cancelled()
                except Exception:  # noqa: BLE001
                    log.exception("cancelling %s failed", key)
