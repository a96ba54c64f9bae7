"""decode's feeds (tensors.DECODE_FEED_OPEN): one response per step for many streams' outputs.

A front streaming many answers from decode pays, per output, a response through the stub,
tritonserver and its own gRPC reader. A feed folds the outputs of one step, for every
stream that names it, into one response of two string tensors, so those costs are paid
per step instead (docs/client-contract.md, "Decode's feed").

`DecodeFeeds` is touched only on decode's outbox thread, like the streams' senders; it
reaches them through a `FeedTransport` (decode's model gives it Triton's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdchat.core.errors import Unavailable

log = logging.getLogger(__name__)


class FeedTransport(Protocol):
    def send(self, sender: Any, keys: list[str], responses: list[str]) -> None:
        """One response of a feed: outputs `responses` (RESPONSE JSON) of the streams `keys`."""
        ...

    def end(self, sender: Any, error: Exception | None) -> None:
        """The feed's last response: a bare final flag, or `error`."""
        ...


@dataclass(eq=False)
class _Feed:
    sender: Any
    streams: set[str] = field(default_factory=set)  # the feed keys of the open streams it carries
    idle_since: float = field(default_factory=time.monotonic)  # when its last stream left (or it opened)
    pending: list[tuple[str, str]] = field(default_factory=list)  # (key, RESPONSE JSON) for its next response


class DecodeFeeds:
    """The open feeds by id, the streams each carries, and the outputs each holds for its
    next response.

    NOTE: a feed is held only while it carries streams. Each opened with a grant that chat
    sealed for it (one feed a grant, and grants come only with tickets); at most MAX_FEEDS
    are open, and a feed opened past that takes the place of the one idle longest (no
    stream names it). It is refused (Unavailable) only when every open feed carries
    streams, and its caller then streams unfed: no caller can keep a front's feed out by
    holding idle ones."""

    MAX_FEEDS = 64

    def __init__(
        self, transport: FeedTransport, on_closed: Callable[[str], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`on_closed(feed)`: called as each feed closes, whatever closed it."""
        self._transport = transport
        self._on_closed = on_closed
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}

    def open(self, feed: str, sender: Any) -> bool:
        """Hold `sender` (the feed request's) as feed `feed`; an id already open is replaced.
        False when MAX_FEEDS carry streams: `sender` is then answered Unavailable, and closed."""
        self.close(feed)
        if len(self._feeds) >= self.MAX_FEEDS:
            idle = [(entry.idle_since, name) for name, entry in self._feeds.items() if not entry.streams]
            if not idle:
                error = Unavailable(f"this decode carries streams on all of its {self.MAX_FEEDS} feeds; stream unfed")
                self._end(sender, error, feed)
                return False
            self.close(min(idle)[1])
        self._feeds[feed] = _Feed(sender, idle_since=self._clock())
        return True

    def attach(self, feed: str, key: str) -> bool:
        """Carry the stream of feed key `key` on `feed` from now on; False when `feed` is not open."""
        entry = self._feeds.get(feed)
        if entry is None:
            return False
        entry.streams.add(key)
        return True

    def detach(self, feed: str, key: str) -> None:
        """The stream of feed key `key` ended (attached or not)."""
        entry = self._feeds.get(feed)
        if entry is not None and key in entry.streams:
            entry.streams.discard(key)
            if not entry.streams:
                entry.idle_since = self._clock()

    def close(self, feed: str) -> None:
        """Forget feed `feed` (its caller cancelled it, a send to it failed, or it gave its
        place) and end its request; its pending outputs are dropped: its caller's streams
        see their fed count fall short and fail on its side."""
        entry = self._feeds.pop(feed, None)
        if entry is not None:
            self._on_closed(feed)
            self._end(entry.sender, None, feed)

    def add(self, feed: str, key: str, response: str) -> bool:
        """Queue one output (its RESPONSE JSON) of stream `key` for feed `feed`'s next
        response; False when the feed is not open (the caller then sends it on the stream)."""
        entry = self._feeds.get(feed)
        if entry is None:
            return False
        entry.pending.append((key, response))
        return True

    def flush(self) -> None:
        """Send each feed its queued outputs as one response."""
        for feed, entry in list(self._feeds.items()):
            if not entry.pending:
                continue
            outputs, entry.pending = entry.pending, []
            try:
                self._transport.send(entry.sender, [key for key, _ in outputs], [body for _, body in outputs])
            except Exception:  # noqa: BLE001 - the feed's caller is gone: its streams end there
                log.warning("feed %s: sending failed; closing it", feed, exc_info=True)
                self.close(feed)

    def close_all(self) -> None:
        for feed in list(self._feeds):
            self.close(feed)

    def _end(self, sender: Any, error: Exception | None, feed: str) -> None:
        try:
            self._transport.end(sender, error)
        except Exception:  # noqa: BLE001 - a caller already gone
            log.debug("closing feed %s: its caller is gone", feed, exc_info=True)
