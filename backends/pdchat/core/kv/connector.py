"""The KV connectors by name, and the set one model process uses, swept in the background;
decode's hold on one request's handle (`KVHandover`).

- `shm`: same host (core.kv.shm).
- `nixl`: NIXL over UCX, for servers on different hosts (core.kv.nixl).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pdchat.core.errors import InvalidRequest
from pdchat.core.kv.base import KVConnector, KVHandle, KVUnavailable, OncePerKey, tokens_from
from pdchat.core.kv.nixl import NixlConnector
from pdchat.core.kv.shm import ShmConnector, kv_directory, sweep_directory
from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.registry import KV_CONNECTORS

CONNECTORS: dict[str, type] = {ShmConnector.name: ShmConnector, NixlConnector.name: NixlConnector}
assert tuple(CONNECTORS) == KV_CONNECTORS, "registry.KV_CONNECTORS and the connector classes disagree"

_sweep_failures = OncePerKey()
log = logging.getLogger("pdchat.kv")


def make_connector(name: str, **options: Any) -> KVConnector:
    if name not in CONNECTORS:
        raise InvalidRequest(f"unknown KV connector {name!r}; expected one of {', '.join(CONNECTORS)}")
    return CONNECTORS[name](**options)


class Connectors:
    """The connectors of one model process, made on first use; swept, and the KV of requests
    that ended before their pull discarded, on a background thread."""

    SWEEP_INTERVAL_S = 1.0

    def __init__(self, on_sweep: Callable[[dict[str, int]], None] | None = None, **options: Any):
        """`on_sweep` receives the bytes each connector holds after every sweep (for metrics)."""
        self._on_sweep = on_sweep
        self._options = options
        self._made: dict[str, KVConnector] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._discards: queue.SimpleQueue[KVHandle | None] = queue.SimpleQueue()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="pdchat-kv-sweep", daemon=True)
        self._sweeper.start()

    def get(self, name: str) -> KVConnector:
        with self._lock:
            if name not in self._made:
                self._made[name] = make_connector(name, **self._options)
            return self._made[name]

    def publish(
        self,
        destination: str,
        kv: np.ndarray,
        first_token_id: int,
        first_token_logprobs: TokenLogprobs | None = None,
        cached_tokens: int = 0,
    ) -> KVHandle:
        """Prefill's KV published through the `destination` connector; the handle carries the
        first token, its logprobs and the prompt tokens prefill's prefix cache gave."""
        published = self.get(destination).publish(kv, first_token_id)
        return replace(published, first_token_logprobs=first_token_logprobs, cached_tokens=cached_tokens)

    def pull(self, handle: KVHandle, start_token: int = 0) -> np.ndarray:
        """The handle's KV of tokens from `start_token` on."""
        if handle.connector not in CONNECTORS:
            raise KVUnavailable(f"the KV handle names no known connector: {handle.connector!r}")
        return self.get(handle.connector).pull(handle, start_token)

    def done(self, handle: KVHandle) -> None:
        self.get(handle.connector).done(handle)

    def discard(self, handle: KVHandle) -> None:
        """Free the KV of a handle whose request ended before its pull, soon, on the
        background thread (telling a NIXL peer may wait on the network).

        NOTE: only for a handle this server's seal vouched for: a discard frees the KV."""
        if handle.connector in CONNECTORS:
            self._discards.put(handle)

    def close(self) -> None:
        """Stop the background thread (discards not made by then leave their KV to its TTL)
        and close every connector."""
        self._stop.set()
        self._discards.put(None)
        self._sweeper.join(5)
        with self._lock:
            for connector in self._made.values():
                connector.close()
            self._made.clear()

    def _sweep_loop(self) -> None:
        swept_at = time.monotonic()
        while not self._stop.is_set():
            try:
                handle = self._discards.get(timeout=max(0.0, swept_at + self.SWEEP_INTERVAL_S - time.monotonic()))
            except queue.Empty:
                handle = None
            if handle is not None:
                self._discard_now(handle)
            if time.monotonic() - swept_at >= self.SWEEP_INTERVAL_S and not self._stop.is_set():
                swept_at = time.monotonic()
                try:
                    self.sweep_once()
                except Exception as exc:  # noqa: BLE001 - the sweeper must outlive any one failure
                    _sweep_failures.warn(f"sweep:{type(exc).__name__}:{exc}", "KV sweep failed (will retry): %s", exc)

    def _discard_now(self, handle: KVHandle) -> None:
        try:
            self.get(handle.connector).discard(handle)
        except Exception as exc:  # noqa: BLE001 - the KV then waits for its TTL
            log.warning("discarding %s KV failed, it is freed at its TTL: %s", handle.connector, exc)

    def sweep_once(self) -> None:
        """Sweep every connector made here, and the shm KV directory (if there is one) before
        this process made its shm connector: a survivor that has not published or pulled yet
        (a restarted server, a decode server still idle) frees what a dead peer left there
        within SWEEP_INTERVAL_S too."""
        with self._lock:
            connectors = list(self._made.values())
            shm_unmade = ShmConnector.name not in self._made
        for connector in connectors:
            connector.sweep()
        directory = self._options.get("directory") or kv_directory()
        if shm_unmade and Path(directory).is_dir():  # never made here for a process that uses no shm KV
            sweep_directory(directory)
        if self._on_sweep is not None:
            self._on_sweep({c.name: c.held_bytes() for c in connectors})


class KVHandover:
    """Decode's hold on the KV handle of one request: its generation pulls the KV at most
    once and hands it back (`done`); a request that ends before the pull discards it
    (`end`), so a request cancelled, failed or expired in decode's queue does not leave
    prefill's KV held until its TTL.

    NOTE: pull() and end() exclude each other: after end() a pull gets KVUnavailable, and
    end() discards only KV never pulled."""

    def __init__(self, connectors: Connectors, handle: KVHandle):
        self.handle = handle
        self._connectors = connectors
        self._lock = threading.Lock()
        self._pulled = self._ended = False
        self._prefetched: np.ndarray | KVUnavailable | None = None

    @property
    def pull_waits(self) -> bool:
        """Its pull waits on another process or host (KVConnector.pull_waits): `prefetch` it."""
        connector = CONNECTORS.get(self.handle.connector)
        return connector is not None and connector.pull_waits

    def prefetch(self) -> None:
        """Pull the whole KV now, on the caller's thread, for `pull` to serve from memory; a
        failure is kept for `pull` to raise."""
        with self._lock:
            if self._ended or self._pulled:
                return
            self._pulled = True
        try:
            self._prefetched = self._connectors.pull(self.handle)
        except KVUnavailable as exc:
            self._prefetched = exc

    def pull(self, start_token: int = 0) -> np.ndarray:
        """The KV of tokens from `start_token` on (Connectors.pull), from memory when it was
        prefetched."""
        with self._lock:
            if self._ended:
                raise KVUnavailable("the request ended before its KV was pulled")
            self._pulled = True
        prefetched = self._prefetched
        if isinstance(prefetched, KVUnavailable):
            raise prefetched
        if prefetched is not None:
            return tokens_from(prefetched, start_token) if start_token else prefetched
        return self._connectors.pull(self.handle, start_token)

    def decode_source(self, request_id: str, counted: Callable[[str], None]) -> dict[str, Any]:
        """The KV fields of decode's DecodeRequest (core.engine_api): its source (pull_or_none),
        its release (done) and, where the pull waits on the network (NIXL), its prefetch, which
        the engine runs before the request joins, off its stepping thread."""
        return {
            "kv_source": functools.partial(self.pull_or_none, request_id=request_id, counted=counted),
            "on_kv_released": self.done,
            "prefetch_kv": self.prefetch if self.pull_waits else None,
        }

    def pull_or_none(self, start_token: int, *, request_id: str, counted: Callable[[str], None]) -> np.ndarray | None:
        """The KV of tokens from `start_token` on, or None where it cannot be had (expired,
        prefill gone: decode then computes the prompt from the ids, never rendering it again);
        `counted("pulled")` or `counted("recomputed")`, the failure logged."""
        try:
            kv = self.pull(start_token)
        except KVUnavailable as exc:
            log.warning("request %s: KV pull failed, recomputing prefill from the forwarded ids: %s", request_id, exc)
            counted("recomputed")
            return None
        counted("pulled")
        return kv

    def done(self) -> None:
        """The pulled KV is no longer read (Connectors.done)."""
        self._connectors.done(self.handle)

    def end(self) -> bool:
        """The request ended: discard its KV unless it was pulled; whether it did (once)."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
            if self._pulled:
                return False
        self._connectors.discard(self.handle)
        return True
