"""decode's feeds (tensors.DECODE_FEED_OPEN): one response per step for many streams' outputs.

A front streaming many answers from decode pays, per output, a response through the stub,
tritonserver and its own gRPC reader. A feed folds the outputs of one step, for every
stream that names it, into one response of two string tensors, so those costs are paid
per step instead (docs/benchmarks.md, "Steps on the per-token path").

`DecodeFeeds` is touched only on decode's outbox thread, like the streams' senders.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.errors import Unavailable
from pdchat.triton import io

log = logging.getLogger(__name__)


class DecodeFeeds:
    """The open feeds by id, and the outputs each holds for its next response.

    NOTE: at most MAX_FEEDS are open: a feed opens without a seal, and each open one is a
    request held and polled for its cancellation."""

    MAX_FEEDS = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counted = 0  # feeds reserved (on any thread) and not closed yet
        self._senders: dict[str, Any] = {}
        self._pending: dict[str, list[tuple[str, str]]] = {}

    def open(self, feed: str, sender: Any) -> None:
        """Hold `sender` (the feed request's) as feed `feed`, counted by `reserve` before; an
        id already open is replaced."""
        self.close(feed)
        self._senders[feed] = sender

    def holds(self, feed: str) -> bool:
        return feed in self._senders

    def reserve(self) -> None:
        """Count one more feed about to `open` (from any thread); Unavailable when MAX_FEEDS
        are open or about to."""
        with self._lock:
            if self._counted >= self.MAX_FEEDS:
                raise Unavailable(f"this decode holds {self.MAX_FEEDS} feeds, its most; close one first")
            self._counted += 1

    def close(self, feed: str) -> None:
        """Forget feed `feed` (its caller cancelled it, or a send to it failed); its pending
        outputs are dropped: the caller's streams fail on its side when the feed ends there."""
        sender = self._senders.pop(feed, None)
        self._pending.pop(feed, None)
        if sender is not None:
            with self._lock:
                self._counted -= 1
            try:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # noqa: BLE001 - a caller already gone
                log.debug("closing feed %s: its caller is gone", feed, exc_info=True)

    def add(self, feed: str, key: str, response: str) -> bool:
        """Queue one output (its RESPONSE JSON) of stream `key` for feed `feed`'s next
        response; False when the feed is not open (the caller then sends it on the stream)."""
        if feed not in self._senders:
            return False
        self._pending.setdefault(feed, []).append((key, response))
        return True

    def flush(self) -> None:
        """Send each feed its queued outputs as one response."""
        pending, self._pending = self._pending, {}
        for feed, outputs in pending.items():
            keys = np.array([key.encode() for key, _ in outputs], dtype=np.object_)
            bodies = np.array([body.encode() for _, body in outputs], dtype=np.object_)
            output_tensors = [pb_utils.Tensor(tensors.FEED_KEYS, keys), pb_utils.Tensor(tensors.FEED_RESPONSES, bodies)]
            try:
                io.send_tensors(self._senders[feed], output_tensors)
            except Exception:  # noqa: BLE001 - the feed's caller is gone: its streams end there
                log.warning("feed %s: sending failed; closing it", feed, exc_info=True)
                self.close(feed)

    def close_all(self) -> None:
        for feed in list(self._senders):
            self.close(feed)
