"""Moving a prompt's KV cache from a prefill server to a decode server.

A connector publishes KV on the prefill side and returns a handle (plain JSON, signed
into kv_transfer_params with the ids); the decode side pulls by handle and says when it
is done with it. Prefill holds each KV until then or until its TTL passes.

- `shm`: same host. Each KV is one file in /dev/shm whose name carries its expiry, so
  any pdchat process can sweep what a crashed peer left behind. Pulling maps it (no
  copy); once decode's cache no longer uses the mapping (after its first step) it hands
  the file back, renamed as free, and prefill writes the next KV into those pages:
  faulting fresh tmpfs pages in costs more than the copy itself.
- `nixl`: NIXL over UCX, for servers on different hosts (core/nixl_connector.py).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pdchat.core.errors import Unavailable

SHM_PREFIX = "pdchat_kv_"
FREE_PREFIX = "pdchat_kvfree_"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}(?P<engine>[0-9a-f]+)_(?P<expires_ms>\d+)_(?P<id>[0-9a-f]+)$")
_SWEEPABLE = re.compile(r"^pdchat_kv(free)?_(?P<engine>[0-9a-f]+)_(?P<expires_ms>\d+)_(?P<id>[0-9a-f]+)$")
DEFAULT_BUDGET_BYTES = 2 << 30
DEFAULT_KV_TTL_S = 60.0

log = logging.getLogger(__name__)


class _OncePerKey:
    """Logs a warning the first time a key is seen: a foreign entry in /dev/shm is worth
    one line, not one per sweep."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._seen:
            self._seen.add(key)
            log.warning(message, *args)


_skipped = _OncePerKey()


def _regular_files(directory: Path, pattern: str) -> Iterator[tuple[Path, os.stat_result]]:
    """Regular files matching `pattern`, with their stat; anything else there (a directory,
    a link, a socket someone planted, an entry gone meanwhile) is skipped, never fatal."""
    for path in directory.glob(pattern):
        try:
            info = path.lstat()
        except OSError:  # removed meanwhile
            continue
        if stat.S_ISREG(info.st_mode):
            yield path, info
        else:
            _skipped.warn(str(path), "skipping %s: not a regular file (not pdchat's)", path)


class KVUnavailable(RuntimeError):
    """The KV named by a handle cannot be had (expired, pulled already, peer gone)."""


class KVBudgetExceeded(Unavailable):
    """Holding this KV would pass the server's KV budget."""


class KVConnector(Protocol):
    name: str

    def publish(self, kv: np.ndarray, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hold `kv` for a decode server; return its handle (with `extra` merged in)."""

    def pull(self, handle: dict[str, Any]) -> np.ndarray:
        """Fetch the KV a handle names."""

    def done(self, handle: dict[str, Any]) -> None:
        """The pulled KV is no longer read: the prefill side may free or reuse it."""

    def sweep(self) -> int:
        """Free expired KV; return how many were freed."""

    def held_bytes(self) -> int:
        """Bytes this connector currently holds for pulls."""

    def close(self) -> None:
        """Free everything this connector holds."""


class ShmConnector:
    name = "shm"

    def __init__(self, directory: Path = Path("/dev/shm"), *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 ttl_s: float = DEFAULT_KV_TTL_S, engine_id: str | None = None):
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.engine_id = engine_id or uuid.uuid4().hex[:12]

    def publish(self, kv: np.ndarray, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        self.sweep()
        kv = np.ascontiguousarray(kv, dtype=np.float32)
        if self.held_bytes() + kv.nbytes > self.budget_bytes:
            raise KVBudgetExceeded(
                f"holding {kv.nbytes >> 20} MiB more KV would pass this server's budget of "
                f"{self.budget_bytes >> 20} MiB (PDCHAT_KV_BUDGET_MB); retry when pulls have freed some"
            )
        expires_at = time.time() + self.ttl_s
        name = f"{SHM_PREFIX}{self.engine_id}_{int(expires_at * 1000)}_{uuid.uuid4().hex}"
        staging = self.directory / f".{name}"
        # Into a handed-back file's resident pages if one fits (no truncation: keep them).
        with open(staging, "r+b" if self._reuse_free_file(staging, kv.nbytes) else "wb") as out:
            out.write(memoryview(kv).cast("B"))
        staging.rename(self.directory / name)  # whole or absent, never half-written
        return {"connector": self.name, "name": name, "shape": list(kv.shape), "expires_at": round(expires_at, 3), **(extra or {})}

    def pull(self, handle: dict[str, Any]) -> np.ndarray:
        """Map the KV (no copy). Call done() once nothing reads it any more."""
        path = self._path(handle)
        shape = tuple(int(n) for n in handle["shape"])
        nbytes = int(np.prod(shape)) * 4
        try:
            # Not through a link, and never blocking on a FIFO someone planted under a KV name.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise KVUnavailable(f"KV {handle.get('name')} is gone (expired, already pulled, or its prefill server restarted)") from None
        except OSError as exc:
            raise KVUnavailable(f"KV {handle.get('name')} cannot be opened: {exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise KVUnavailable(f"KV {handle['name']} is not a regular file")
            size = info.st_size
            if size < nbytes:  # a reused file may be larger than this KV
                raise KVUnavailable(f"KV {handle['name']} has {size} bytes, its handle says {list(shape)}")
            # Copy-on-write: writable for torch, yet nothing is copied unless written.
            mapping = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        return np.frombuffer(mapping, dtype=np.float32).reshape(shape)

    def done(self, handle: dict[str, Any]) -> None:
        """Decode no longer reads the pulled KV: hand its pages back to prefill for reuse
        (for a KV TTL; then any sweeper frees them, also if prefill has died)."""
        path = self._path(handle)
        match = _SHM_NAME.match(path.name)
        free = f"{FREE_PREFIX}{match['engine']}_{int((time.time() + self.ttl_s) * 1000)}_{match['id']}"
        try:
            path.rename(self.directory / free)
        except FileNotFoundError:  # expired and swept meanwhile
            pass

    def _reuse_free_file(self, staging: Path, nbytes: int) -> bool:
        """Move the smallest handed-back file that fits to `staging`; False if none."""
        sizes = [(info.st_size, path) for path, info in _regular_files(self.directory, f"{FREE_PREFIX}{self.engine_id}_*")]
        for _, path in sorted(s for s in sizes if s[0] >= nbytes):
            try:
                path.rename(staging)
                return True
            except FileNotFoundError:  # swept meanwhile
                continue
        return False

    def sweep(self, now: float | None = None) -> int:
        """Free expired KV of any engine on this host (a crashed peer's too). Entries it
        cannot parse or remove are skipped (logged once), so nobody's stray file stops it."""
        now_ms = (now or time.time()) * 1000
        freed = 0
        for path, _ in _regular_files(self.directory, "pdchat_kv*"):
            match = _SWEEPABLE.match(path.name)
            if match is None:
                _skipped.warn(str(path), "skipping %s: named like pdchat KV but not one", path)
                continue
            if int(match["expires_ms"]) >= now_ms:
                continue
            try:
                path.unlink()
                freed += 1
            except FileNotFoundError:  # pulled or swept by another process meanwhile
                pass
            except OSError as exc:
                _skipped.warn(str(path), "cannot remove expired KV %s: %s", path, exc)
        return freed

    def held(self) -> list[Path]:
        return sorted(path for path, _ in _regular_files(self.directory, f"{SHM_PREFIX}{self.engine_id}_*"))

    def held_bytes(self) -> int:
        return sum(info.st_size for _, info in _regular_files(self.directory, f"{SHM_PREFIX}{self.engine_id}_*"))

    def close(self) -> None:
        for path in self.held() + [p for p, _ in _regular_files(self.directory, f"{FREE_PREFIX}{self.engine_id}_*")]:
            path.unlink(missing_ok=True)

    def _path(self, handle: dict[str, Any]) -> Path:
        name = str(handle.get("name", ""))
        if not _SHM_NAME.match(name):
            raise KVUnavailable(f"not a shm KV name: {name!r}")
        return self.directory / name


def make_connector(name: str, **options: Any) -> KVConnector:
    if name == ShmConnector.name:
        return ShmConnector(**options)
    if name == "nixl":
        from pdchat.core.nixl_connector import NixlConnector

        return NixlConnector(**options)
    raise ValueError(f"unknown KV connector {name!r}; expected shm or nixl")


class Connectors:
    """The connectors of one model process, made on first use, swept in the background."""

    SWEEP_INTERVAL_S = 1.0

    def __init__(self, on_sweep: Callable[[dict[str, int]], None] | None = None, **options: Any):
        """`on_sweep` receives the bytes each connector holds after every sweep (for metrics)."""
        import threading

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

    def pull(self, handle: dict[str, Any]) -> np.ndarray:
        connector = handle.get("connector") if isinstance(handle, dict) else None
        if connector not in ("shm", "nixl"):
            raise KVUnavailable(f"the KV handle names no known connector: {connector!r}")
        return self.get(connector).pull(handle)

    def done(self, handle: dict[str, Any]) -> None:
        self.get(handle["connector"]).done(handle)

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
                _skipped.warn(f"sweep:{type(exc).__name__}:{exc}", "KV sweep failed (will retry): %s", exc)

    def sweep_once(self) -> None:
        with self._lock:
            connectors = list(self._made.values())
        for connector in connectors:
            connector.sweep()
        if self._on_sweep is not None:
            self._on_sweep({c.name: c.held_bytes() for c in connectors})
