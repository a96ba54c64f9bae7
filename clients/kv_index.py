"""Which KV blocks each prefill server holds, as its KV events say (pdchat.core.kv_events):
what the router's prefix affinity checks its guesses against.

The link between a routed request and a server's blocks is the token ids. The router has
no tokenizer, but prefill answers every request with its prompt's ids, and every
BlockStored carries the stored blocks' token ids and the server's key of their parent. The
server's keys themselves cannot be computed here: their root carries the server's model
path, dtype and the request's `cache_salt` (paged.root_hash), which no event says. So the
index keys each held block by content, a chained hash of the token ids from the first
block on (`content_key`), found from the event's parent: a block stored under a parent the
index does not hold (its event was lost) is skipped, and a block is usable only while
every block before it is held too, as a prompt reuses only the cached blocks it starts
with. A prompt's blocks are then `prompt_key(ids)`, whatever the server's root.

NOTE: content keys carry no salt: two tenants whose prompts start with the same tokens
share them here, though not on the server. The router's own table is keyed by salt, so
this only matters after one tenant's blocks were evicted while the other's stayed: the
router still counts them held, and the request costs one prefill, never a wrong answer.

`KVEventSubscriber` feeds one server's index from a thread of its own: a ZMQ SUB socket on
its events endpoint and, for the messages it missed (a gap in `seq`, or joining late), the
server's replay socket. What no replay can fill (no replay endpoint, the buffer moved on,
no answer) starts the index over and calls `on_reset`, as does a server that restarted
(its `seq` went back).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from pdchat.core.kv_events import END_SEQ, Cleared, Event, Removed, curve_client, decode
from pdchat.core.settings import KV_EVENTS_CURVE_DIR

log = logging.getLogger("pdchat.router.kv_events")
_ROOT = 0  # the parent of a first block's content key
POLL_MS = 100  # how often the subscriber thread looks at its stop flag
REPLAY_TIMEOUT_S = 2.0  # longest wait for each message of a replay


def content_key(parent: int, token_ids: Sequence[int]) -> int:
    """A block's content key: its parent's (`_ROOT` for a first block) and its token ids."""
    data = parent.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass
class IndexStats:
    messages: int = 0  # event batches applied
    replayed: int = 0  # of them, read from the replay socket
    skipped_blocks: int = 0  # stored under a parent the index did not hold
    undecodable: int = 0  # messages not applied: no EventBatch, or blocks of another size
    resets: int = 0  # the index started over: a gap no replay filled, a restart


class BlockIndex:
    """One server's held blocks by content key (see the module's docstring), from its events.
    Thread-safe: one subscriber thread applies, the router's request threads ask."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.stats = IndexStats()
        self._content: dict[int, int] = {}  # the server's block key -> content key
        self._held: dict[int, list[int]] = {}  # content key -> [server blocks holding it, its parent's content key]
        self._lock = threading.Lock()

    def prompt_key(self, token_ids: Sequence[int]) -> int | None:
        """The content key of the last full block of a prompt: what its next turn finds held on
        a server that prefilled it (None: the prompt fills no block)."""
        size, key = self.block_size, _ROOT
        for start in range(0, len(token_ids) - size + 1, size):
            key = content_key(key, token_ids[start : start + size])
        return None if key == _ROOT else key

    def holds(self, key: int) -> bool:
        """Whether the server holds the block of content key `key` and every block before it."""
        with self._lock:
            while key != _ROOT:
                node = self._held.get(key)
                if node is None:
                    return False
                key = node[1]
            return True

    def apply(self, events: list[Event]) -> None:
        """One message's events, in order."""
        with self._lock:
            self.stats.messages += 1
            for event in events:
                if isinstance(event, Removed):
                    for block in event.block_hashes:
                        self._remove(block)
                elif isinstance(event, Cleared):
                    self._content.clear()
                    self._held.clear()
                else:
                    self._store(event.block_hashes, event.parent, event.token_ids)

    def reset(self) -> None:
        """Forget every block: what the server holds is no longer known."""
        with self._lock:
            self._content.clear()
            self._held.clear()
            self.stats.resets += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._content)

    def _store(self, blocks: list[int], parent: int | None, token_ids: list[int]) -> None:
        parent_key = _ROOT if parent is None else self._content.get(parent)
        if parent_key is None:  # its parent's event was lost: its content is unknown
            self.stats.skipped_blocks += len(blocks)
            return
        for index, block in enumerate(blocks):
            tokens = token_ids[index * self.block_size : (index + 1) * self.block_size]
            key = content_key(parent_key, tokens)
            if block not in self._content:
                self._content[block] = key
                node = self._held.setdefault(key, [0, parent_key])
                node[0] += 1
            parent_key = key

    def _remove(self, block: int) -> None:
        key = self._content.pop(block, None)
        if key is None:
            return
        node = self._held[key]
        node[0] -= 1
        if node[0] == 0:
            del self._held[key]


class KVEventSubscriber:
    """Feeds `index` from one server's KV events on a thread of its own (see the module's
    docstring): `endpoint` its PUB socket, `replay_endpoint` its ROUTER replay socket (None:
    a gap starts the index over). `on_reset` is called from that thread after the index
    started over. `curve_dir` (None: setting KV_EVENTS_CURVE_DIR): the CURVE certificates that
    subscribe to a publisher which requires them (core.kv_events.curve_client). Call close() to stop."""

    def __init__(
        self,
        index: BlockIndex,
        endpoint: str,
        replay_endpoint: str | None = None,
        on_reset: Callable[[], None] | None = None,
        curve_dir: str | None = None,
    ):
        self.index, self.endpoint, self.replay_endpoint = index, endpoint, replay_endpoint
        self._on_reset = on_reset
        self._curve_dir = curve_dir or KV_EVENTS_CURVE_DIR.get() or None
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pdchat-kv-events-{endpoint}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._context.destroy(linger=0)

    # On the subscriber thread:

    def _run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # the endpoint is this server's: every topic on it
        sub.connect(self.endpoint)
        expected: int | None = None  # the next seq wanted
        try:
            while not self._stop.is_set():
                if not sub.poll(POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("KV events from %s: ignored a message of %d frames", self.endpoint, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big")
                if expected is not None and seq < expected:
                    self._reset(f"its seq went back from {expected} to {seq} (the server restarted)")
                    expected = None
                start = 0 if expected is None else expected
                if seq != start and not self._catch_up(start, seq):
                    self._reset(f"messages {start} to {seq - 1} were lost and no replay had them")
                self._apply(frames[2], replayed=False)
                expected = seq + 1
        finally:
            sub.close(0)

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve_dir is not None:
            curve_client(socket, self._curve_dir)
        return socket

    def _catch_up(self, start: int, end: int) -> bool:
        """Apply messages `start` to `end - 1` from the replay socket; whether it had them all."""
        if self.replay_endpoint is None:
            return False
        replay = self._socket(zmq.DEALER)
        replay.connect(self.replay_endpoint)
        try:
            replay.send_multipart((b"", start.to_bytes(8, "big")))
            wanted = start
            while replay.poll(int(REPLAY_TIMEOUT_S * 1000)):
                _, seq_bytes, payload = replay.recv_multipart()
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if seq == wanted and seq < end:
                    self._apply(payload, replayed=True)
                    wanted += 1
            return wanted == end
        finally:
            replay.close(0)

    def _apply(self, payload: bytes, replayed: bool) -> None:
        try:
            events = decode(payload, self.index.block_size)
        except ValueError as exc:  # said once: a wrong block size would fail every message
            (log.debug if self.index.stats.undecodable else log.warning)(
                "KV events from %s: a message was not applied: %s", self.endpoint, exc
            )
            self.index.stats.undecodable += 1
            return
        self.index.apply(events)
        if replayed:
            self.index.stats.replayed += 1

    def _reset(self, why: str) -> None:
        log.warning("KV events from %s: %s; its block index starts over", self.endpoint, why)
        self.index.reset()
        if self._on_reset is not None:
            self._on_reset()


@dataclass(frozen=True)
class KVEventSource:
    """Where one prefill server publishes its KV events: its PUB endpoint and, if any, its
    replay (ROUTER) endpoint."""

    endpoint: str
    replay_endpoint: str | None = None


def parse_sources(sources: Sequence[str], replay_sources: Sequence[str] = ()) -> dict[str, KVEventSource]:
    """`SERVER=ENDPOINT` strings, as vllm-router's --kv-event-source and --kv-event-replay-source
    take them, by server. Raises ValueError naming a malformed one, a server given twice, a
    replay source without an event source, or several endpoints for one server (vllm-router's
    comma list, one per data-parallel rank: pdchat's prefill runs one instance per server)."""

    def pairs(values: Sequence[str], flag: str) -> dict[str, str]:
        found: dict[str, str] = {}
        for value in values:
            server, sep, endpoint = value.partition("=")
            if not sep or not server or not endpoint:
                raise ValueError(f"{flag} takes SERVER=ENDPOINT, got {value!r}")
            if "," in endpoint:
                raise ValueError(f"{flag} {value!r}: one endpoint per server (pdchat's prefill runs one instance)")
            if server in found:
                raise ValueError(f"{flag}: {server} given twice")
            _check_endpoint(flag, value, endpoint)
            found[server] = endpoint
        return found

    events, replays = pairs(sources, "--kv-event-source"), pairs(replay_sources, "--kv-event-replay-source")
    if unknown := sorted(set(replays) - set(events)):
        raise ValueError(f"--kv-event-replay-source for {', '.join(unknown)}, which has no --kv-event-source")
    return {server: KVEventSource(endpoint, replays.get(server)) for server, endpoint in events.items()}


def _check_endpoint(flag: str, value: str, endpoint: str) -> None:
    """ZMQ's own check of `endpoint`'s form, by connecting a socket closed at once (a connect
    sends nothing). Otherwise a malformed one (`host:5557`, no `tcp://`) would only kill its
    subscriber thread once the router runs, and the prefix policy would find no block held."""
    context = zmq.Context()
    try:
        socket = context.socket(zmq.SUB)
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"{flag} {value!r}: not a ZMQ endpoint ({exc}); e.g. tcp://host:5557") from None
        finally:
            socket.close(0)
    finally:
        context.destroy(linger=0)
