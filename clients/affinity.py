"""Prefix affinity: send a conversation's next turn to the prefill server that holds its
prefix in its KV cache.

A server's prefix cache pays only if the next turn of a conversation reaches the server
that computed the last one; with N servers and least-loaded routing that happens about
1/N of the time. This policy remembers, per server, the conversation prefixes it sent
there, keyed like KV blocks by a chained hash, here of whole messages (the router sees
requests, not token ids): the root carries what changes every rendered token (the model,
`cache_salt`, the tools, `chat_template_kwargs`), then each message chains on the ones
before. A request goes to the server whose remembered chain matches the most of its
leading messages, unless that server carries `max_extra_load` more requests in flight
than the least loaded one (then the least loaded); what it routed is remembered there.
Entries age out after `ttl_s` and a server keeps at most `max_entries` (least recently
used first out), so the table stays bounded whatever the traffic.

Where a server publishes its KV events, the guess is checked against them
(clients/kv_index.py): once prefill answers, the request's last key is bound to the
content key of its prompt's last full block (`bind`), and from then on a bound key counts
on that server only while the server's block index holds that block and every one before
it. So a conversation whose blocks the server evicted no longer draws its next turn there:
its score falls to its longest prefix still held, or 0 (then the least loaded).

NOTE: without events the table is a guess at what a server caches: a server may have
evicted a prefix, or (restarted) lost them all; a wrong guess costs one prefill of the
prefix, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdchat.clients.kv_index import BlockIndex

# Request fields that change a rendered prompt from its first token on.
ROOT_FIELDS = ("model", "cache_salt", "tools", "chat_template_kwargs", "reasoning_effort")


def prefix_keys(body: dict[str, Any]) -> list[bytes]:
    """The chained keys of a chat request's leading messages: key i stands for messages 0..i
    and what the root holds."""
    root = {name: body.get(name) for name in ROOT_FIELDS}
    parent = hashlib.blake2b(json.dumps(root, sort_keys=True, default=str).encode(), digest_size=16).digest()
    keys = []
    for message in body.get("messages") or []:
        text = json.dumps(message, sort_keys=True, default=str).encode()
        parent = hashlib.blake2b(parent + text, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixAffinity:
    """Which server to send a request to, by the prefixes each was sent and, for the servers
    in `indexes`, the blocks their KV events say they hold. Thread-safe."""

    def __init__(
        self,
        *,
        max_extra_load: int = 2,
        ttl_s: float = 600.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        indexes: Mapping[str, BlockIndex] | None = None,
    ):
        self.max_extra_load = max_extra_load
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.indexes = dict(indexes or {})
        self._clock = clock
        # server -> key -> [last routed, content key of its prompt's last full block or None]
        self._seen: dict[str, OrderedDict[bytes, list]] = {}
        self._lock = threading.Lock()
        self.matched_messages = 0  # of requests routed: leading messages found on the chosen server
        self.routed_messages = 0

    def choose(self, keys: Sequence[bytes], loads: dict[str, int]) -> str:
        """The server (a key of `loads`: the ready servers and their requests in flight) for a
        request with these prefix keys; remembers the choice."""
        if not loads:
            raise ValueError("no server to choose from")
        now = self._clock()
        with self._lock:
            least = min(loads.values())
            matches = {server: self._match(server, keys, now) for server in loads}
            eligible = [s for s in loads if loads[s] <= least + self.max_extra_load]
            best = max(eligible, key=lambda s: (matches[s], -loads[s]))
            if matches[best] == 0:
                best = min(loads, key=lambda s: loads[s])  # nothing cached anywhere it may go: least loaded
            self.matched_messages += matches[best]
            self.routed_messages += len(keys)
            self._remember(best, keys, now)
            return best

    def scores(self, keys: Sequence[bytes], servers: Sequence[str]) -> dict[str, int]:
        """Each server's score for a request with these prefix keys, as `choose` weighs them:
        its leading messages found there (and still held, where events say)."""
        now = self._clock()
        with self._lock:
            return {server: self._match(server, keys, now) for server in servers}

    def bind(self, server: str, key: bytes, block_key: int | None) -> None:
        """The request whose last prefix key is `key`, routed to `server`, left its prompt's
        full blocks there, the last of content key `block_key` (BlockIndex.prompt_key; None:
        no full block): `key` now counts there only while the server's index holds it."""
        with self._lock:
            entry = self._seen.get(server, {}).get(key)
            if entry is not None and block_key is not None:
                entry[1] = block_key

    def forget(self, server: str) -> None:
        """The server lost its cache (it restarted, or says it cleared its blocks)."""
        with self._lock:
            self._seen.pop(server, None)

    def _match(self, server: str, keys: Sequence[bytes], now: float) -> int:
        """Leading keys routed to `server` within the TTL; where the server has an index, up
        to the deepest bound key it still holds (none held: 0)."""
        seen = self._seen.get(server)
        count, bound = 0, []  # bound: (position, content key)
        for key in keys:
            entry = None if seen is None else seen.get(key)
            if entry is None or now - entry[0] > self.ttl_s:
                break
            if entry[1] is not None:
                bound.append((count, entry[1]))
            count += 1
        index = self.indexes.get(server)
        if index is None or not bound:
            return count
        for position, block_key in reversed(bound):
            if index.holds(block_key):
                return count if position == bound[-1][0] else position + 1
        return 0

    def _remember(self, server: str, keys: Sequence[bytes], now: float) -> None:
        seen = self._seen.setdefault(server, OrderedDict())
        for key in keys:
            entry = seen.get(key)
            if entry is None:
                seen[key] = [now, None]
            else:
                entry[0] = now
                seen.move_to_end(key)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)
        while seen and now - next(iter(seen.values()))[0] > self.ttl_s:
            seen.popitem(last=False)
