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

NOTE: an affinity table is a guess at what a server caches: a server may have evicted a
prefix, or (restarted) lost them all; a wrong guess costs one prefill of the prefix, never
a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

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
    """Which server to send a request to, by the prefixes each was sent. Thread-safe."""

    def __init__(
        self,
        *,
        max_extra_load: int = 2,
        ttl_s: float = 600.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_extra_load = max_extra_load
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._seen: dict[str, OrderedDict[bytes, float]] = {}  # server -> key -> last routed
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

    def forget(self, server: str) -> None:
        """The server lost its cache (it restarted, or says it cleared its blocks)."""
        with self._lock:
            self._seen.pop(server, None)

    def _match(self, server: str, keys: Sequence[bytes], now: float) -> int:
        seen = self._seen.get(server)
        count = 0
        for key in keys:
            routed = None if seen is None else seen.get(key)
            if routed is None or now - routed > self.ttl_s:
                break
            count += 1
        return count

    def _remember(self, server: str, keys: Sequence[bytes], now: float) -> None:
        seen = self._seen.setdefault(server, OrderedDict())
        for key in keys:
            seen[key] = now
            seen.move_to_end(key)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)
        while seen and now - next(iter(seen.values())) > self.ttl_s:
            seen.popitem(last=False)
