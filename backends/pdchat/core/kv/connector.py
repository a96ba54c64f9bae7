"""The KV connectors by name, and the set one model process uses, swept in the background.

- `shm`: same host (core.kv.shm).
- `nixl`: NIXL over UCX, for servers on different hosts (core.kv.nixl).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pdchat.core.errors import InvalidRequest
from pdchat.core.kv.base import KVConnector, KVHandle, KVUnavailable, OncePerKey
from pdchat.core.kv.nixl import NixlConnector
from pdchat.core.kv.shm import ShmConnector, kv_directory, sweep_directory
from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.registry import KV_CONNECTORS

CONNECTORS: dict[str, type] = {ShmConnector.name: ShmConnector, NixlConnector.name: NixlConnector}
assert tuple(CONNECTORS) == KV_CONNECTORS, "registry.KV_CONNECTORS and the connector classes disagree"

_sweep_failures = OncePerKey()


def make_connector(name: str, **options: Any) -> KVConnector:
    if name not in CONNECTORS:
        raise InvalidRequest(f"unknown KV connector {name!r}; expected one of {', '.join(CONNECTORS)}")
    return CONNECTORS[name](**options)


class Connectors:
    """The connectors of one model process, made on first use, swept in the background."""

    SWEEP_INTERVAL_S = 1.0

    def __init__(self, on_sweep: Callable[[dict[str, int]], None] | None = None, **options: Any):
        """`on_sweep` receives the bytes each connector holds after every sweep (for metrics)."""
        self._on_sweep = on_sweep
        self._options = options
        self._made: dict[str, KVConnector] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
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

    def close(self) -> None:
        self._stop.set()
        self._sweeper.join(5)
        with self._lock:
            for connector in self._made.values():
                connector.close()
            self._made.clear()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.SWEEP_INTERVAL_S):
            try:
                self.sweep_once()
            except Exception as exc:  # noqa: BLE001 - the sweeper must outlive any one failure
                _sweep_failures.warn(f"sweep:{type(exc).__name__}:{exc}", "KV sweep failed (will retry): %s", exc)

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
