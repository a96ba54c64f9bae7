"""KV events in vLLM's wire format: what a prefill or decode pool keys, evicts and clears,
published for cache-aware routers (vllm-router, Dynamo's KV router, llm-d's scorer).

The wire, as vLLM's `vllm/distributed/kv_events.py` and its `ZmqEventPublisher` define it:

- a message is a msgpack `EventBatch` `[ts, events, data_parallel_rank]`, its events
  `BlockStored`, `BlockRemoved`, `AllBlocksCleared`: msgspec Structs tagged with their
  class name, fields in vLLM's order and types. `layout="map"` (the default) encodes each
  event as a map with the tag under `"type"`, as current vLLM does (its own `KVEventBatch`
  decodes nothing else); `layout="array"` as a positional array, tag first
  (`array_like=True`, vLLM before its PR #42892), for consumers that old. A sequence's
  first block carries its request's `cache_salt` in `extra_keys`, as vLLM's does, so a
  consumer that keys blocks from their tokens (llm-d) keeps tenants apart.
- a PUB socket sends it as multipart `[topic, seq, payload]`, `seq` 8 bytes big-endian,
  from 0 and up by one per message;
- a ROUTER socket answers a request `[identity, b"", start]` (8 bytes big-endian) with
  every buffered message whose seq is `start` or later, `[identity, b"", seq, payload]`
  each, then `[identity, b"", -1 (8 bytes, signed), b""]`.

An endpoint with `*`, `::`, `ipc://` or `inproc://` is bound, any other connected to (as vLLM does),
but a loopback address (127.0.0.1, localhost, [::1]) is bound too: events only this host
reads. Events carry every prompt's token ids: one bound to all interfaces is logged as a
warning unless CURVE is on (`curve_dir`: pyzmq certificates; the sockets then encrypt, and a
ZAP handler takes only subscribers whose public keys are in `authorized/`).

Never in a step's way: the pool's thread only appends to a bounded queue (`BlockEvents`);
the publisher's own thread drains it, batches and encodes what it found, and sends
without blocking. Nothing blocks on a subscriber: events past the queue's bound are
dropped (counted), and a message a subscriber's full socket queue cannot take is not
sent (counted; XPUB's no-drop mode makes the send say so) but keeps its seq and its place
in the replay buffer, so a subscriber sees the gap and asks the replay socket for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import msgspec
import zmq
import zmq.auth

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay
LAYOUTS = ("array", "map")
QUEUE_EVENTS = 100_000  # events waiting for the publisher thread (vLLM's max_queue_size)
SOCKET_HWM = 100_000  # messages queued per subscriber before a send is refused (vLLM's hwm)
POLL_S = 0.01  # how long the publisher thread waits for events or a replay request
# CURVE certificates (zmq.auth.create_certificates names) in a curve_dir.
SERVER_SECRET, SERVER_PUBLIC, CLIENT_SECRET, AUTHORIZED = (
    "server.key_secret",
    "server.key",
    "client.key_secret",
    "authorized",
)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `EventBatch`: positional in both layouts."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_types(array_like: bool) -> tuple[type, type, type]:
    """vLLM's BlockStored, BlockRemoved, AllBlocksCleared, in one layout (tag = class name)."""

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


_TYPES = {"array": _event_types(True), "map": _event_types(False)}
_ARRAY_EVENT, _MAP_EVENT = (Union[_TYPES[layout]] for layout in LAYOUTS)  # noqa: UP007 - a union of a tuple


# What the pool's thread queues: plain tuples, built in well under a microsecond.
@dataclass(frozen=True)
class Stored:
    block_hashes: list[int]  # a chain: each block's parent is the one before
    parent: int | None  # the first block's parent; None: it starts a sequence
    token_ids: list[int]  # every block's, in order
    # One entry per block: what its key covers beside its tokens, as vLLM publishes it (a
    # sequence's first block: (cache_salt,) when the request had one), else None.
    extra_keys: list[tuple[Any, ...] | None]


@dataclass(frozen=True)
class Removed:
    block_hashes: list[int]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def coalesce(raw: Iterable[tuple]) -> list[Event]:
    """Queued `("stored", key, parent, token_ids, extra_keys)`, `("removed", key)`, `("cleared",)` in
    order, as few events: a stored block whose parent is the previous stored block's key
    joins its event, consecutive removals join one event; the order is kept."""
    events: list[Event] = []
    for item in raw:
        kind = item[0]
        last = events[-1] if events else None
        if kind == "stored":
            _, key, parent, token_ids, extra = item
            if isinstance(last, Stored) and parent is not None and last.block_hashes[-1] == parent:
                last.block_hashes.append(key)
                last.token_ids.extend(token_ids)
                last.extra_keys.append(extra)
            else:
                events.append(Stored([key], parent, list(token_ids), [extra]))
        elif kind == "removed":
            if isinstance(last, Removed):
                last.block_hashes.append(item[1])
            else:
                events.append(Removed([item[1]]))
        else:
            events.append(Cleared())
    return events


def encode(events: list[Event], block_size: int, rank: int, layout: str = "map", ts: float | None = None) -> bytes:
    """One message's payload: `events` as vLLM's EventBatch, msgpack."""
    stored_type, removed_type, cleared_type = _TYPES[layout]
    wire = []
    for event in events:
        if isinstance(event, Stored):
            wire.append(
                stored_type(
                    block_hashes=event.block_hashes,
                    parent_block_hash=event.parent,
                    token_ids=event.token_ids,
                    block_size=block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=event.extra_keys if any(keys is not None for keys in event.extra_keys) else None,
                    group_idx=0,  # one KV cache group: every layer keeps every block
                )
            )
        elif isinstance(event, Removed):
            wire.append(removed_type(block_hashes=event.block_hashes, medium=MEDIUM_GPU, group_idx=0))
        else:
            wire.append(cleared_type())
    batch = EventBatch(ts=time.time() if ts is None else ts, events=wire, data_parallel_rank=rank)
    return msgspec.msgpack.encode(batch)


def decode(payload: bytes, block_size: int) -> list[Event]:
    """The inverse of `encode`, for a consumer (pdchat's router): a message's events as
    Stored / Removed / Cleared in order, each read in whichever layout it came (an array:
    positional, tag first; a map: tagged under "type"). Raises ValueError for a payload that
    is no EventBatch of these events, or a BlockStored whose block size is not `block_size`
    (its tokens would be cut into other blocks than the consumer's)."""
    try:
        batch = msgspec.msgpack.decode(payload, type=EventBatch)
        wire = [msgspec.convert(e, _ARRAY_EVENT if isinstance(e, list) else _MAP_EVENT) for e in batch.events]
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not a KV events batch: {exc}") from exc
    events: list[Event] = []
    for event in wire:
        name = type(event).__name__
        if name == "BlockStored":
            if event.block_size != block_size:
                raise ValueError(f"blocks of {event.block_size} tokens, expected {block_size}")
            extra = event.extra_keys or [None] * len(event.block_hashes)
            events.append(
                Stored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    [None if keys is None else tuple(keys) for keys in extra],
                )
            )
        elif name == "BlockRemoved":
            events.append(Removed(event.block_hashes))
        else:
            events.append(Cleared())
    return events


class BlockEvents:
    """The sink a BlockPool tells of its blocks (pool.events): a bounded queue the pool's
    thread appends to and never waits on. Full: the event is dropped and counted in
    `dropped`. Thread-safe for one producer and one consumer (deque's append and popleft)."""

    def __init__(self, capacity: int = QUEUE_EVENTS):
        self.capacity = capacity
        self.dropped = 0
        self._queue: deque[tuple] = deque()

    def stored(
        self, key: int, parent: int | None, token_ids: list[int], extra_keys: tuple[Any, ...] | None = None
    ) -> None:
        """A full block was keyed: `key`, its parent block's key (None: the first of its
        sequence), its token ids and what else its key covers (`Stored.extra_keys`)."""
        self._put(("stored", key, parent, token_ids, extra_keys))

    def removed(self, key: int) -> None:
        """The keyed block `key` was evicted."""
        self._put(("removed", key))

    def cleared(self) -> None:
        """Every cached block was forgotten."""
        self._put(("cleared",))

    def drain(self, limit: int | None = None) -> list[tuple]:
        """What is queued, oldest first (at most `limit`)."""
        items = []
        while self._queue and (limit is None or len(items) < limit):
            items.append(self._queue.popleft())
        return items

    def __len__(self) -> int:
        return len(self._queue)

    def _put(self, item: tuple) -> None:
        if len(self._queue) >= self.capacity:
            self.dropped += 1
        else:
            self._queue.append(item)


class ReplayBuffer:
    """The last `size` messages, `(seq, payload)`, for subscribers that missed them."""

    def __init__(self, size: int):
        self._messages: deque[tuple[int, bytes]] = deque(maxlen=size)

    def append(self, seq: int, payload: bytes) -> None:
        self._messages.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered messages whose seq is `start` or later, in order."""
        return [(seq, payload) for seq, payload in self._messages if seq >= start]


def instance_endpoint(endpoint: str | None, index: int) -> str | None:
    """The endpoint of model instance `index`: tcp ports go up by one per instance, other
    transports get `_<index>` after their address (as vLLM offsets by data-parallel rank)."""
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"a KV events tcp endpoint needs a port: {endpoint!r}")
        return f"{base}:{int(port) + index}"
    return f"{endpoint}_{index}"


_LOOPBACK_HOSTS = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://", *_LOOPBACK_HOSTS))


def _all_interfaces(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and ("*" in endpoint or "[::]" in endpoint)


def curve_server(context: zmq.Context, curve_dir: str) -> tuple[Any, bytes, bytes]:
    """CURVE for a publisher: a started ZAP authenticator that takes the public keys in
    `<curve_dir>/authorized/`, and the server's key pair from `<curve_dir>/server.key_secret`."""
    from zmq.auth.thread import ThreadAuthenticator

    directory = Path(curve_dir)
    public, secret = zmq.auth.load_certificate(directory / SERVER_SECRET)
    if secret is None:
        raise ValueError(f"{directory / SERVER_SECRET} holds no secret key")
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(directory / AUTHORIZED))
    return authenticator, public, secret


def curve_client(socket: zmq.Socket, curve_dir: str) -> None:
    """Make `socket` a CURVE client of a publisher: its key pair from `<curve_dir>/client.key_secret`,
    the publisher's public key from `<curve_dir>/server.key`."""
    directory = Path(curve_dir)
    public, secret = zmq.auth.load_certificate(directory / CLIENT_SECRET)
    server_public, _ = zmq.auth.load_certificate(directory / SERVER_PUBLIC)
    socket.curve_publickey, socket.curve_secretkey, socket.curve_serverkey = public, secret, server_public


@dataclass(frozen=True)
class PublisherStats:
    published: int  # messages sent
    dropped_events: int  # events the queue had no room for
    dropped_messages: int  # messages not sent: a subscriber's socket queue was full


class KVEventPublisher:
    """Publishes one pool's `events` (a BlockEvents) from a thread of its own: a PUB
    socket on `endpoint`, a ROUTER replay socket on `replay_endpoint` (None: no replay)
    answering from the last `buffer_steps` messages. `rank` goes in every batch's
    data_parallel_rank (pdchat: the model instance). `on_stats`, if given, is called from
    the publisher thread when the counts changed, at most about once a second.
    Raises zmq.ZMQError here if a socket cannot be bound or connected."""

    def __init__(
        self,
        events: BlockEvents,
        *,
        endpoint: str,
        block_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        rank: int = 0,
        layout: str = "map",
        curve_dir: str | None = None,
        on_stats: Callable[[PublisherStats], None] | None = None,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"KV events layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.events = events
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._block_size, self._rank, self._layout = block_size, rank, layout
        self._curve_dir = curve_dir
        if curve_dir is None and _all_interfaces(endpoint):
            log.warning(
                "KV events on %s reach whoever reaches this host, in plaintext, every prompt's token ids "
                "among them: bind a loopback address, or set kv_events_curve_dir",
                endpoint,
            )
        self._topic = topic.encode()
        self._replay_buffer = ReplayBuffer(buffer_steps)
        self._on_stats = on_stats
        self._seq = 0
        self.published = self.dropped_messages = 0
        self._stop = threading.Event()
        self._close_timeout_s = 1.0
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        # Sockets are made, used and closed on the publisher thread only (zmq sockets are not thread-safe).
        self._thread = threading.Thread(target=self._run, name="pdchat-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def stats(self) -> PublisherStats:
        return PublisherStats(self.published, self.events.dropped, self.dropped_messages)

    def close(self, timeout_s: float = 1.0) -> None:
        """Publish what is queued (for up to `timeout_s`), then close the sockets."""
        self._close_timeout_s = timeout_s
        self._stop.set()
        self._thread.join(timeout_s + 1.0)

    # On the publisher thread:

    def _run(self) -> None:
        context = zmq.Context.instance()
        authenticator = None
        try:
            if self._curve_dir is not None:
                authenticator, public, secret = curve_server(context, self._curve_dir)
            pub = context.socket(zmq.XPUB)  # a PUB that says when a subscriber's queue is full
            pub.setsockopt(zmq.XPUB_NODROP, 1)
            pub.setsockopt(zmq.SNDHWM, SOCKET_HWM)
            pub.setsockopt(zmq.LINGER, 0)
            replay = context.socket(zmq.ROUTER) if self.replay_endpoint else None
            for socket in (pub, replay):
                if socket is not None and authenticator is not None:
                    socket.curve_server, socket.curve_publickey, socket.curve_secretkey = True, public, secret
            (pub.bind if _binds(self.endpoint) else pub.connect)(self.endpoint)
            if replay is not None:
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor
            if authenticator is not None:
                authenticator.stop()
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)  # subscriptions, read and dropped
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        reported, last_report = self.stats(), 0.0
        deadline: float | None = None
        try:
            while True:
                stopping = self._stop.is_set()
                if stopping and deadline is None:
                    deadline = time.monotonic() + self._close_timeout_s
                ready = dict(poller.poll(0 if len(self.events) else POLL_S * 1000))
                if pub in ready:
                    self._read_subscriptions(pub)
                if replay is not None and replay in ready:
                    self._answer_replay(replay)
                raw = self.events.drain(limit=QUEUE_EVENTS)
                if raw:
                    self._send(pub, encode(coalesce(raw), self._block_size, self._rank, self._layout))
                now = time.monotonic()
                if self._on_stats is not None and (stopping or now - last_report >= 1.0):
                    current = self.stats()
                    if current != reported:
                        self._report(current)
                        reported = current
                    last_report = now
                if stopping and (not len(self.events) or now >= deadline):
                    break
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            if authenticator is not None:
                authenticator.stop()

    def _send(self, pub: zmq.Socket, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._replay_buffer.append(seq, payload)
        try:
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped_messages += 1  # kept for replay; the subscriber sees the gap

    @staticmethod
    def _read_subscriptions(pub: zmq.Socket) -> None:
        while True:
            try:
                pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _answer_replay(self, replay: zmq.Socket) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignored a replay request of %d frames", len(frames))
                continue
            identity, _, start = frames
            try:
                for seq, payload in self._replay_buffer.since(int.from_bytes(start, "big")):
                    replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                replay.send_multipart((identity, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("KV events: a replay subscriber's queue is full; its replay was cut short")

    def _report(self, stats: PublisherStats) -> None:
        try:
            self._on_stats(stats)
        except Exception:  # noqa: BLE001 - a metric failing never stops the events
            log.exception("KV events: reporting the counts failed")
