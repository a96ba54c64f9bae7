"""decode's response streams: each request's outputs, from its deltas to its stream's end.

A `DecodeStream` is one request's stream: its sender, its assembler (deltas -> client
outputs), what its caller asked for, and where its outputs go (its own stream, or decode's
feed, `core.output.feeds`). `DecodeStreams` sends each stream's outputs and ends it once,
finished, failed or cancelled, through a `StreamTransport` (decode's model gives it
Triton's) and tells a `StreamObserver` (its metrics).

NOTE: everything here runs on decode's outbox thread, the one thread that calls into the
server process for its streams; the scheduler thread hands deltas over to it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdchat.core.engine_api import DecodeCallbacks
from pdchat.core.output.feeds import DecodeFeeds, FeedTransport
from pdchat.core.output.responses import ClientOutput, Delta

log = logging.getLogger(__name__)


class StreamTransport(FeedTransport, Protocol):
    def send_output(self, sender: Any, output: ClientOutput, wanted: frozenset[str], fed: int | None) -> None:
        """One response of `output`'s client outputs named in `wanted`, the stream's last when
        `output` is final; `fed`: a fed stream's count of outputs sent through its feed."""
        ...

    def heartbeat(self, sender: Any) -> None:
        """An empty response: the stream is alive, nothing new."""
        ...

    def fail(self, sender: Any, error: Exception) -> None:
        """The stream's last response: `error`, in band (a failure after the stream started)."""
        ...


class StreamObserver(Protocol):
    def started(self, key: str) -> None:
        """Stream `key` was admitted into decode's batch."""
        ...

    def emitted(self, key: str, tokens: int) -> None:
        """Stream `key` sent an output of `tokens` tokens decode generated."""
        ...

    def ended(self, key: str, outcome: str, started: bool, finish_reason: str | None = None) -> None:
        """Stream `key` ended: `outcome` finished (for `finish_reason`: stop, length), failed or cancelled."""
        ...


class Assembler(Protocol):
    def on_delta(self, delta: Delta) -> list[ClientOutput]: ...


@dataclass(eq=False)  # hashed by identity: the outbox watches the stream itself
class DecodeStream:
    """One request's response stream; touched only on the outbox thread."""

    key: str
    sender: Any
    assembler: Assembler
    wanted: frozenset[str]  # the client outputs its caller requested
    heartbeat_s: float | None = None  # an empty response after this long without one (None: never)
    given_first: bool = False  # its first output token was prefill's (not decode's to count)
    kv: Any = None  # prefill's KV (core.kv.connector.KVHandover), when its handle came sealed: ended with it
    feed: str | None = None  # the feed its caller named; None once not fed
    feed_key: str = ""
    sent_at: float = field(default_factory=time.monotonic)  # its last response
    started: bool = False  # admitted: counted until it ends
    open: bool = True
    outputs: int = 0  # outputs sent
    finish_reason: str | None = None  # its last delta's, once sent
    fed: int = 0  # outputs sent through the feed


class DecodeStreams:
    """Sends decode's streams their outputs and ends each once.

    `cancel(key)` stops a stream's row in the scheduler (a stream whose send failed);
    `unwatch(stream)` stops the poll of its caller's cancellation."""

    def __init__(
        self,
        transport: StreamTransport,
        observer: StreamObserver,
        feeds: DecodeFeeds,
        cancel: Callable[[str], None],
        unwatch: Callable[[Hashable], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.transport = transport
        self.observer = observer
        self.feeds = feeds
        self._cancel = cancel
        self._unwatch = unwatch
        self._clock = clock

    def callbacks(self, stream: DecodeStream, post: Callable[..., None]) -> DecodeCallbacks:
        """An engine's callbacks for `stream`: each hands its work to `post(function, *args)`,
        which runs it on the outbox thread (the engine calls them on a thread of its own)."""
        return DecodeCallbacks(
            started=functools.partial(post, self.started, stream),
            emit=functools.partial(post, self.send, stream),
            fail=functools.partial(post, self.close, stream, "failed"),
            cancelled=functools.partial(post, self.close, stream, "cancelled"),
        )

    def started(self, stream: DecodeStream) -> None:
        stream.started = True
        self.observer.started(stream.key)

    def send(self, stream: DecodeStream, delta: Delta) -> None:
        """The outputs of one delta: through its feed (all but the last, when fed) or on its
        stream; the last ends the stream. A send that fails ends it failed and stops its row."""
        if not stream.open:
            return
        try:
            self._send_outputs(stream, delta)
            if stream.heartbeat_s is not None and self._clock() - stream.sent_at >= stream.heartbeat_s:
                self.transport.heartbeat(stream.sender)  # a whole answer still being made
                stream.sent_at = self._clock()
        except Exception as exc:  # noqa: BLE001 - this stream ends; the batch goes on
            log.exception("request %s: sending a response failed", stream.key)
            self._cancel(stream.key)
            self.close(stream, "failed", exc)
            return
        given = 1 if stream.given_first and stream.outputs == 0 else 0  # prefill sampled it
        stream.outputs += 1
        self.observer.emitted(stream.key, max(len(delta.token_ids) - given, 0))
        if delta.finish_reason:
            stream.finish_reason = delta.finish_reason
            self.close(stream, "finished", send=False)  # its last output was sent final

    def _send_outputs(self, stream: DecodeStream, delta: Delta) -> None:
        if stream.feed is not None and stream.outputs == 0 and not self.feeds.attach(stream.feed, stream.feed_key):
            stream.feed = None  # fed from its first output on or not at all: its outputs stay in order
        for output in stream.assembler.on_delta(delta):
            if stream.feed is not None and not output.final:
                if self.feeds.add(stream.feed, stream.feed_key, output.response):
                    stream.fed += 1
                    continue
            fed = None
            if stream.feed is not None and output.final:
                self.feeds.flush()  # its fed outputs leave before its last
                fed = stream.fed
            self.transport.send_output(stream.sender, output, stream.wanted, fed)
            stream.sent_at = self._clock()

    def close(self, stream: DecodeStream, outcome: str, error: Exception | None = None, *, send: bool = True) -> None:
        """End the stream once: its last response `error` (in band), or a bare final flag
        (none with `send=False`: its last output went final). Its KV, if never pulled, is freed."""
        if not stream.open:
            return
        stream.open = False
        if stream.feed is not None:
            self.feeds.detach(stream.feed, stream.feed_key)
        if stream.kv is not None:
            stream.kv.end()
        self._unwatch(stream)
        self.observer.ended(stream.key, outcome, stream.started, stream.finish_reason)
        if not send:
            return
        try:
            if error is None:
                self.transport.end(stream.sender, None)
            else:
                self.transport.fail(stream.sender, error)
        except Exception:  # noqa: BLE001 - a client already gone
            log.exception("request %s: closing its stream failed", stream.key)
