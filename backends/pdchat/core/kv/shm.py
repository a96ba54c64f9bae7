"""KV over shared memory, for prefill and decode servers on one host.

KV lives in a directory only this user may enter (default `/dev/shm/pdchat-<uid>`, mode
0700, files 0600): other local users can neither list nor read it. Each KV is one file
whose name carries its expiry, so any pdchat process of this user sweeps what a crashed
peer left behind. A pull first claims the file by renaming it (atomic: of racing pulls
exactly one wins, so a handle is good for one pull), then maps it (no copy). Once decode's
cache no longer uses the mapping (after its first step) it hands the file back, renamed as
free, and prefill writes the next KV into those pages: faulting fresh tmpfs pages in costs
more than the copy itself.

A KV file is `<prefix><engine>_<expires_ms>_<id>`, the engine being the prefill that
published it (whose budget it counts against), the prefix its state:

- `.pdchat_kv_`: being written (published whole or not at all);
- `pdchat_kv_`: published, waiting for its one pull;
- `pdchat_kvpulled_`: claimed by a pull, name ending `_<puller engine>`; mapped by decode;
- `pdchat_kvfree_`: handed back; prefill reuses its pages.

Each connector (an engine) holds `pdchat_kvowner_<engine>` locked (flock) while it lives.
The kernel drops the lock when its process dies, however it dies, so a sweeper that can
take an engine's lock knows its owner is gone, whatever pid namespace either runs in. It
then frees what only the dead engine would have used or freed: the pages handed back to
it, the KV it was writing, the KV it claimed. The KV it published waits for its pull or
its expiry: a decode server may still pull it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pdchat.core.errors import PdchatError
from pdchat.core.kv.base import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_KV_TTL_S,
    KVBudgetExceeded,
    KVHandle,
    KVUnavailable,
    OncePerKey,
    kv_dtype_name,
    tokens_from,
)
from pdchat.core.settings import KV_BUDGET_MB
from pdchat.registry import SHM

SHM_ROOT = Path("/dev/shm")
SHM_PREFIX = "pdchat_kv_"
STAGING_PREFIX = f".{SHM_PREFIX}"
PULLED_PREFIX = "pdchat_kvpulled_"
FREE_PREFIX = "pdchat_kvfree_"
OWNER_PREFIX = "pdchat_kvowner_"
_KV_NAME = re.compile(
    rf"(?P<prefix>{re.escape(STAGING_PREFIX)}|{SHM_PREFIX}|{PULLED_PREFIX}|{FREE_PREFIX})"
    r"(?P<engine>[0-9a-f]+)_(?P<expires_ms>\d+)_(?P<id>[0-9a-f]+)(?:_(?P<puller>[0-9a-f]+))?"
)
_ENGINE_ID = re.compile(r"[0-9a-f]+")
_OWNER_NAME = re.compile(rf"{OWNER_PREFIX}(?P<engine>[0-9a-f]+)")
_PRIVATE_MODE = 0o700
_FILE_MODE = 0o600
# Never through a link, and never blocking on a FIFO someone planted under a KV name.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK
# How often a new connector tries for its owner lock while a sweeper briefly holds it.
_OWNER_LOCK_TRIES = 100

_skipped = OncePerKey()


class KVDirectoryRefused(PdchatError, PermissionError):
    """The KV directory is not private to this user: others could read KV there, or plant it.

    NOTE: an OSError too, which `ShmConnector.pull` turns into KVUnavailable."""


def _host_id() -> str:
    """What shares /dev/shm: this boot of this machine, and this network namespace (a
    container or pod of its own has both its own namespace and its own /dev/shm)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return "unknown"
    return f"{boot}:{netns}"


# In the handle prefill signs: decode maps shm KV only on the host that wrote it.
HOST_ID = _host_id()


def kv_directory() -> Path:
    """Where ShmConnector keeps KV unless told otherwise: this user's own directory in /dev/shm."""
    return SHM_ROOT / f"pdchat-{os.getuid()}"


@dataclass(frozen=True)
class _KVName:
    """A KV file's name, parsed: what the sweeper, the budget and a pull need to know
    without opening the file."""

    prefix: str
    engine: str
    expires_ms: int
    kv_id: str
    puller: str = ""

    def __str__(self) -> str:
        tail = f"_{self.puller}" if self.puller else ""
        return f"{self.prefix}{self.engine}_{self.expires_ms}_{self.kv_id}{tail}"

    @classmethod
    def parse(cls, name: str) -> _KVName | None:
        """None unless `name` is a KV file's; only a claimed file names its puller."""
        match = _KV_NAME.fullmatch(name)
        if match is None or bool(match["puller"]) != (match["prefix"] == PULLED_PREFIX):
            return None
        return cls(match["prefix"], match["engine"], int(match["expires_ms"]), match["id"], match["puller"] or "")

    def left_by(self, dead: set[str]) -> bool:
        """Whether only one of the `dead` engines would ever have used or freed this file:
        pages handed back to it, KV it was writing, KV it claimed and never handed back."""
        if self.prefix in (FREE_PREFIX, STAGING_PREFIX):
            return self.engine in dead
        return self.prefix == PULLED_PREFIX and self.puller in dead


def expired_files(directory: Path | None = None, now: float | None = None) -> list[Path]:
    """KV files past their expiry in `directory`: what a sweep must have freed (whoever's)."""
    now_ms = (time.time() if now is None else now) * 1000
    directory = directory or kv_directory()
    return sorted(
        path
        for path in directory.glob("*pdchat_kv*")
        if (name := _KVName.parse(path.name)) is not None and name.expires_ms < now_ms
    )


def _why_not_private(info: os.stat_result) -> str | None:
    """What makes a directory unfit to hold KV, or None if only this user can use it."""
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):04o} lets group or others in (want {_PRIVATE_MODE:04o})"
    return None


def _open_private(directory: Path) -> int:
    """An fd of `directory`, created 0700 if missing, checked private: files are then
    reached relative to it (dir_fd), so the checked directory is the one used even if the
    path is swapped meanwhile. A link there is refused, never followed."""
    with suppress(FileExistsError):
        os.mkdir(directory, _PRIVATE_MODE)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: something else
        raise KVDirectoryRefused(
            f"refusing KV directory {directory}: not a directory, or a link ({exc.strerror})"
        ) from None
    problem = _why_not_private(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise KVDirectoryRefused(f"refusing KV directory {directory}: {problem}; remove it or choose a private one")
    return fd


@contextmanager
def _private_directory(directory: Path) -> Iterator[int]:
    """`_open_private` for one operation: checked again each time, never a stale fd."""
    fd = _open_private(directory)
    try:
        yield fd
    finally:
        os.close(fd)


def _kv_files(dir_fd: int, directory: Path) -> list[tuple[_KVName, int]]:
    """The KV files in the directory, with their sizes."""
    return _entries(dir_fd, directory)[0]


def _entries(dir_fd: int, directory: Path) -> tuple[list[tuple[_KVName, int]], list[str]]:
    """The KV files in the directory, with their sizes, and the engines that have an owner
    lock there. Anything else (a directory, a link, a FIFO someone planted, a foreign name)
    is skipped, logged once, never fatal."""
    files, owners = [], []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            name = _KVName.parse(entry.name)
            owner = _OWNER_NAME.fullmatch(entry.name)
            if owner is not None and stat.S_ISREG(info.st_mode):
                owners.append(owner["engine"])
                continue
            if name is None or not stat.S_ISREG(info.st_mode):
                path = directory / entry.name
                _skipped.warn(
                    str(path), "skipping %s: not a pdchat KV file (not a regular file, or a foreign name)", path
                )
                continue
            files.append((name, info.st_size))
    return files, owners


def _is_at(dir_fd: int, name: str, fd: int) -> bool:
    """Whether `name` in the directory is still the file open as `fd` (neither removed nor replaced)."""
    try:
        there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def _hold_owner_lock(dir_fd: int, engine: str) -> int:
    """An fd that holds `pdchat_kvowner_<engine>` locked for as long as it stays open.

    NOTE: a sweeper removes an owner lock only while holding it and only while the name
    is that file; so once this holds the file at the name, no sweeper takes this engine
    for dead. The lock belongs to the open file, so a child process started by exec
    (close_fds) does not keep it."""
    name = f"{OWNER_PREFIX}{engine}"
    for _ in range(_OWNER_LOCK_TRIES):
        fd = os.open(name, os.O_RDWR | os.O_CREAT | _FILE_FLAGS, _FILE_MODE, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a sweeper is removing a dead namesake's lock, or a live one has this id
            os.close(fd)
            time.sleep(0.01)
            continue
        if _is_at(dir_fd, name, fd):
            return fd
        os.close(fd)  # a sweeper removed it between the open and the lock: make it again
    raise ValueError(f"KV engine id {engine} is taken by a live connector")


def _lock_of_dead_owner(dir_fd: int, engine: str) -> int | None:
    """An fd holding the engine's owner lock if its owner has died (nobody held it), else None."""
    name = f"{OWNER_PREFIX}{engine}"
    try:
        fd = os.open(name, os.O_RDWR | _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:  # another sweeper removed it meanwhile
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its owner lives
        os.close(fd)
        return None
    if not _is_at(dir_fd, name, fd):  # removed meanwhile; the name may be a new owner's now
        os.close(fd)
        return None
    return fd


def _sweep(dir_fd: int, directory: Path, now: float) -> tuple[int, list[tuple[_KVName, int]]]:
    """Remove expired KV files and what dead engines left (`_KVName.left_by`); return how
    many, and the files left. A file it cannot remove is skipped (logged once), so nobody's
    stray file stops it. A dead engine's owner lock goes once no file names that engine.

    NOTE: an engine without an owner lock (a pdchat without them, or one whose file a
    listing missed while it was renamed) is never taken for dead: its files wait for
    their expiry."""
    files, owners = _entries(dir_fd, directory)
    dead = {engine: fd for engine in owners if (fd := _lock_of_dead_owner(dir_fd, engine)) is not None}
    gone, freed, kept = set(dead), 0, []
    try:
        for name, size in files:
            if name.expires_ms >= now * 1000 and not name.left_by(gone):
                kept.append((name, size))
                continue
            try:
                os.unlink(str(name), dir_fd=dir_fd)
                freed += 1
            except FileNotFoundError:  # pulled or swept by another process meanwhile
                pass
            except OSError as exc:
                path = directory / str(name)
                _skipped.warn(str(path), "cannot remove KV %s: %s", path, exc)
        for engine in dead:
            if not any(engine in (name.engine, name.puller) for name, _ in kept):
                with suppress(FileNotFoundError):
                    os.unlink(f"{OWNER_PREFIX}{engine}", dir_fd=dir_fd)
    finally:
        for fd in dead.values():
            os.close(fd)
    return freed, kept


def live_engines(directory: Path | None = None) -> set[str]:
    """The engines of `directory` (this user's KV directory by default) whose owner lock is
    held: their process lives. For a check of what is left, e.g. after a benchmark."""
    directory = kv_directory() if directory is None else Path(directory)
    with _private_directory(directory) as dir_fd:
        _, owners = _entries(dir_fd, directory)
        live = set()
        for engine in owners:
            fd = _lock_of_dead_owner(dir_fd, engine)
            if fd is None:
                live.add(engine)
            else:
                os.close(fd)
    return live


def left_by_dead_engines(names: list[str], live: set[str]) -> list[str]:
    """Of the KV file names `names`, those only an engine not in `live` would have used:
    what a sweep must free at once (`_KVName.left_by`)."""
    parsed = [(name, _KVName.parse(name)) for name in names]
    return [name for name, kv in parsed if kv is not None and kv.left_by({kv.engine, kv.puller} - live - {""})]


def sweep_directory(directory: Path | None = None, now: float | None = None) -> int:
    """`ShmConnector.sweep` for a process without a connector (a launcher whose server
    died): free expired KV and what dead engines left in `directory` (this user's KV
    directory by default); return how many files."""
    directory = kv_directory() if directory is None else Path(directory)
    with _private_directory(directory) as dir_fd:
        freed, _ = _sweep(dir_fd, directory, time.time() if now is None else now)
    return freed


def _map(dir_fd: int, name: str, handle: KVHandle) -> np.ndarray:
    """Copy-on-write map of a claimed KV file: writable for torch, yet nothing is copied
    unless written."""
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise KVUnavailable(f"KV {name} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KVUnavailable(f"KV {name} is not a regular file")
        if info.st_size < handle.nbytes:  # a reused file may be larger than this KV
            raise KVUnavailable(
                f"KV {name} has {info.st_size} bytes, its handle says {list(handle.shape)} {handle.dtype}"
            )
        mapping = mmap.mmap(fd, handle.nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=handle.wire_type).reshape(handle.shape)


class ShmConnector:
    name = SHM
    pull_waits = False  # a copy out of this host's shared memory

    def __init__(
        self,
        directory: Path | None = None,
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        ttl_s: float = DEFAULT_KV_TTL_S,
        engine_id: str | None = None,
    ):
        """Refuses (KVDirectoryRefused) a directory others could use, before any KV is put there."""
        self.directory = kv_directory() if directory is None else Path(directory)
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        if not _ENGINE_ID.fullmatch(self.engine_id):
            raise ValueError(f"engine_id must be lowercase hex (it is part of KV file names), not {self.engine_id!r}")
        with _private_directory(self.directory) as dir_fd:
            self._owner_lock: int | None = _hold_owner_lock(dir_fd, self.engine_id)

    def publish(self, kv: np.ndarray, first_token_id: int) -> KVHandle:
        dtype, kv = kv_dtype_name(kv), np.ascontiguousarray(kv)
        expires_at = time.time() + self.ttl_s
        published = _KVName(SHM_PREFIX, self.engine_id, int(expires_at * 1000), uuid.uuid4().hex)
        staging = str(replace(published, prefix=STAGING_PREFIX))
        with _private_directory(self.directory) as dir_fd:
            _, files = _sweep(dir_fd, self.directory, time.time())
            held = sum(size for _, size in self._held(files))
            if held + kv.nbytes > self.budget_bytes:
                raise KVBudgetExceeded(
                    f"holding {kv.nbytes >> 20} MiB more KV would pass this server's budget of "
                    f"{self.budget_bytes >> 20} MiB ({KV_BUDGET_MB.names}); retry when pulls have freed some"
                )
            free = sorted(
                (size, str(name))
                for name, size in files
                if name.prefix == FREE_PREFIX and name.engine == self.engine_id and size >= kv.nbytes
            )
            fd = self._open_staging(dir_fd, staging, [name for _, name in free])
            try:
                with open(fd, "r+b") as out:  # no truncation: a reused file keeps its resident pages
                    out.write(memoryview(kv).cast("B"))
                os.rename(staging, str(published), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # whole or absent
            except BaseException:
                with suppress(FileNotFoundError):
                    os.unlink(staging, dir_fd=dir_fd)
                raise
        return KVHandle(
            self.name,
            tuple(kv.shape),
            round(expires_at, 3),
            first_token_id,
            {"name": str(published), "host": HOST_ID},
            dtype=dtype,
        )

    def pull(self, handle: KVHandle, start_token: int = 0) -> np.ndarray:
        """Claim the KV, then map it (no copy: only the pages of tokens from `start_token` on
        are read, by whoever copies the view). A handle pulls once: a second pull, or the
        loser of a race, gets KVUnavailable. Call done() once nothing reads it any more."""
        published = self._published(handle)
        claimed = str(replace(published, prefix=PULLED_PREFIX, puller=self.engine_id))
        try:
            dir_fd = _open_private(self.directory)
        except OSError as exc:
            raise KVUnavailable(str(exc)) from None
        try:
            try:
                os.rename(str(published), claimed, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileNotFoundError:
                raise KVUnavailable(
                    f"KV {published} already pulled or gone (expired, or its prefill server restarted)"
                ) from None
            except OSError as exc:
                raise KVUnavailable(f"KV {published} cannot be claimed: {exc.strerror}") from None
            kv = _map(dir_fd, claimed, handle)
            return tokens_from(kv, start_token) if start_token else kv
        finally:
            os.close(dir_fd)

    def done(self, handle: KVHandle) -> None:
        """Decode no longer reads the KV it pulled: hand its pages back to prefill for reuse
        (for a KV TTL; then any sweeper frees them, also if prefill has died). Only the
        connector that claimed it can: nobody recycles pages a puller still maps."""
        self._hand_back(replace(self._published(handle), prefix=PULLED_PREFIX, puller=self.engine_id))

    def discard(self, handle: KVHandle) -> None:
        """Hand KV nobody pulled back to its prefill server's free files, as done() does KV
        that was pulled: its pages carry that server's next KV, and its budget is free at
        once. Nothing if it was claimed meanwhile (the rename finds no file) or is KV of
        another host."""
        try:
            published = self._published(handle)
        except KVUnavailable:
            return  # not a KV file of this host: nothing here to hand back
        self._hand_back(published)

    def sweep(self, now: float | None = None) -> int:
        """Free expired KV of any engine in the directory (a crashed peer's too, and KV a
        crashed decode claimed but never handed back) and, at once, what dead engines
        left; return how many files."""
        return sweep_directory(self.directory, now)

    def held(self) -> list[Path]:
        """This engine's KV files waiting for a pull or claimed by one: what its budget counts."""
        with _private_directory(self.directory) as dir_fd:
            files = _kv_files(dir_fd, self.directory)
        return sorted(self.directory / str(name) for name, _ in self._held(files))

    def held_bytes(self) -> int:
        with _private_directory(self.directory) as dir_fd:
            files = _kv_files(dir_fd, self.directory)
        return sum(size for _, size in self._held(files))

    def close(self) -> None:
        """Remove this engine's files in every state and the KV it claimed (a mapping keeps
        its pages), then its owner lock."""
        with _private_directory(self.directory) as dir_fd:
            for name, _ in _kv_files(dir_fd, self.directory):
                if self.engine_id in (name.engine, name.puller):
                    with suppress(FileNotFoundError):
                        os.unlink(str(name), dir_fd=dir_fd)
            if self._owner_lock is not None:
                with suppress(FileNotFoundError):
                    os.unlink(f"{OWNER_PREFIX}{self.engine_id}", dir_fd=dir_fd)
                os.close(self._owner_lock)
                self._owner_lock = None

    def _held(self, files: list[tuple[_KVName, int]]) -> list[tuple[_KVName, int]]:
        return [
            (name, size)
            for name, size in files
            if name.engine == self.engine_id and name.prefix in (SHM_PREFIX, PULLED_PREFIX)
        ]

    def _hand_back(self, name: _KVName) -> None:
        """Rename KV file `name` to a free file of the prefill engine that wrote it, for a
        TTL; nothing if it is gone (swept, claimed, or not claimed here)."""
        free = replace(name, prefix=FREE_PREFIX, expires_ms=int((time.time() + self.ttl_s) * 1000), puller="")
        with _private_directory(self.directory) as dir_fd, suppress(FileNotFoundError):
            os.rename(str(name), str(free), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def _open_staging(self, dir_fd: int, staging: str, free: list[str]) -> int:
        """A 0600 file at `staging` to write the KV into: the first handed-back file of
        `free` still there (its pages are resident), else a new one."""
        for name in free:
            try:
                os.rename(name, staging, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileNotFoundError:  # swept meanwhile
                continue
            fd = os.open(staging, os.O_RDWR | _FILE_FLAGS, dir_fd=dir_fd)
            os.fchmod(fd, _FILE_MODE)  # whoever handed it back, it stays private
            return fd
        return os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, _FILE_MODE, dir_fd=dir_fd)

    def _published(self, handle: KVHandle) -> _KVName:
        """The published KV a handle names; never a claimed or free file, nor a path, nor
        KV published on another host (its name could match a file here by chance)."""
        if handle.location.get("host") != HOST_ID:
            raise KVUnavailable(
                f"shm KV from another host ({handle.location.get('host')!r}; this is {HOST_ID!r}): "
                "use nixl across hosts"
            )
        name = _KVName.parse(str(handle.location.get("name", "")))
        if name is None or name.prefix != SHM_PREFIX:
            raise KVUnavailable(f"not a shm KV name: {handle.location.get('name')!r}")
        return name
