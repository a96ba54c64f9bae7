"""Prefill's prompt passes and decode's steps taking turns on a host's cores (setting
prefill_takes_cores_ms).

By default the two stage models split a server's cores (torch_threads: half each), so a
prompt's pass runs on half of them while decode steps its rows on the rest: the rows' tokens
come fast and the first tokens slowly. With prefill_takes_cores_ms, a pass takes every core
and decode, before its next step, waits for the pass to end: the way vLLM's steps share
the cores between prompts and rows. Each running row then waits at most one pass per step
(decode steps once between two passes of a long prompt), for no longer than MAX_TURN_S,
and a prefill that dies mid-pass is waited for no more (its process is looked at every
_ALIVE_POLL_S).

Each prefill instance marks its passes in a file of its own, `prefill-pass.<pid>` in
the server's directory (pdchat.ensemble.seal.server_directory): the passes it began and the
running pass's deadline on CLOCK_MONOTONIC (the same clock in every process of the host),
16 bytes, mapped. Decode reads them all before each step, and says it does with a file
of its own, `decode-turns.<pid>`: a decode that does not wait (the setting off on its
server, decode_cpus, vLLM's engine) has no cores to give, and no pass is marked for it.
NOTE: both files are named by their process, so a stub that died, or an instance a reload
replaced, stops counting with its process.

The turns span the servers that share cores (SharedCores): a P/D pair on one host takes
turns as one server does, the decode server waiting for the prefill server's passes. No
Triton import here.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from pdchat.core import procfs
from pdchat.ensemble.decode_load import DecodeLoad
from pdchat.ensemble.seal import live_server_directories

FILE_PREFIX = "prefill-pass."
WAITER_PREFIX = "decode-turns."
_PASS = struct.Struct("<qd")  # passes begun, the running pass's deadline (0.0: none runs)
# The longest decode waits for one pass, whatever its prefill expects. NOTE: a step beside a
# pass on every core slows both, so it must cover a whole pass of prefill_pass_tokens on a
# small model: SmolLM2's take 1.7 s on 2 cores (docs/batching.md#prefill).
MAX_TURN_S = 2.0
MIN_TURN_S = 0.25  # the shortest deadline a pass gets, whatever its prefill expects
_TURN_SLACK = 1.5  # a longer pass's deadline: this many times its expected duration after it began
_POLL_S = 0.0005  # how often a waiting decode looks again
_ALIVE_POLL_S = 0.05  # how often it looks whether the prefill it waits for still runs
_RESCAN_S = 1.0  # how often decode looks for prefill instances that came or went
IN_USE_S = 10.0  # a decode that waits counts while it holds sequences or held some this recently


def _mapped(path: Path, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, _PASS.size)
        return mmap.mmap(fd, _PASS.size)
    finally:
        os.close(fd)


class SharedCores:
    """The server directories whose prefill passes and decode loads take turns on this
    process's cores: its own server's, and those of the host's other live servers
    (live_server_directories) whose tritonserver may run on one of its CPUs. Looked up anew
    every _RESCAN_S.

    NOTE: a server bound to other CPUs (taskset, numactl) shares no core and is left out."""

    def __init__(self, own: Path, clock: Callable[[], float] = time.monotonic):
        self.own, self._clock = own, clock
        self._found, self._found_at = [own], float("-inf")

    def directories(self) -> list[Path]:
        now = self._clock()
        if now - self._found_at >= _RESCAN_S:
            self._found, self._found_at = [self.own, *self._others()], now
        return self._found

    def _others(self) -> list[Path]:
        mine = os.sched_getaffinity(0)
        others = []
        for directory, pid in live_server_directories(self.own.parent).items():
            try:
                if directory != self.own and os.sched_getaffinity(pid) & mine:
                    others.append(directory)
            except OSError:  # gone meanwhile
                continue
        return others


class PassMarks:
    """One prefill instance's passes, marked by its scheduler thread (begin before a pass,
    end after it). NOTE: one writer per file; a reader may see a mark one write old."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic):
        self.path = directory / f"{FILE_PREFIX}{os.getpid()}"
        self._map, self._clock, self._begun = _mapped(self.path, create=True), clock, 0
        self._sharing = SharedCores(directory, clock)
        _PASS.pack_into(self._map, 0, 0, 0.0)

    def begin(self, expected_s: float = MAX_TURN_S) -> bool:
        """Mark a pass where a decode in use on these cores (this server's or a SharedCores
        one's) waits for marks, and none that does not wait holds sequences (their load
        files, pdchat.ensemble.decode_load, say so); whether it did: the pass may take every
        core. Its deadline is `_TURN_SLACK` times `expected_s` (what prefill expects the
        pass to take) after it began, within [MIN_TURN_S, MAX_TURN_S]: decode waits for the
        whole of a long pass, as a step beside a pass on every core slows both, and a short
        pass that runs late past its expectation (a moving average) still gets MIN_TURN_S.

        NOTE: in use is holding sequences or having held some in the last IN_USE_S: one that
        holds nothing when the pass begins may be handed a request during it (in P/D, right
        after the pass before it), and stepping beside a pass on every core slows both
        (marking only while decode held sequences left most passes of a P/D pair unmarked
        at 2k-token prompts, concurrency 4). A decode never used (a P/D prefill server's
        own) gives nothing to wait for. A busy decode that does not wait (decode_cpus, the
        setting at 0 on its server, vLLM's engine) keeps its cores: no pass is marked."""
        waiting, now = False, self._clock()
        for directory in self._sharing.directories():
            load = DecodeLoad(directory)
            if _waits(directory):
                waiting = waiting or load.held_within(IN_USE_S, now)
            elif load.held():
                return False
        if not waiting:
            return False
        self._begun += 1
        turn = min(MAX_TURN_S, max(MIN_TURN_S, _TURN_SLACK * expected_s))
        _PASS.pack_into(self._map, 0, self._begun, self._clock() + turn)
        return True

    def end(self) -> None:
        _PASS.pack_into(self._map, 0, self._begun, 0.0)

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


class PassTurns:
    """Decode's side: before each step, `wait()` while a prefill pass it has not yet waited
    for runs on its server or on one sharing its cores (SharedCores): at most MAX_TURN_S in
    all, and no pass past its deadline."""

    def __init__(
        self,
        directory: Path,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._sharing, self._clock, self._sleep = SharedCores(directory, clock), clock, sleep
        self._waiter = directory / f"{WAITER_PREFIX}{os.getpid()}"
        os.close(os.open(self._waiter, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        self._maps: dict[Path, mmap.mmap] = {}
        self._waited: dict[Path, tuple[int, float]] = {}  # per file, the pass last waited for
        self._scanned_at = float("-inf")

    def wait(self) -> float:
        """Return once no pass runs that this decode has not waited for; the seconds waited."""
        now = started = self._clock()
        if now - self._scanned_at >= _RESCAN_S:
            self._rescan(now)
        for path, marks in self._maps.items():
            mark = _PASS.unpack_from(marks, 0)  # (passes begun, deadline)
            deadline = min(mark[1], started + MAX_TURN_S)  # NOTE: several prefills' passes, one bound
            if deadline <= now or self._waited.get(path) == mark:
                continue
            self._waited[path] = mark
            looked_alive_at = now
            while _PASS.unpack_from(marks, 0) == mark and now < deadline:
                self._sleep(_POLL_S)
                now = self._clock()
                if now - looked_alive_at >= _ALIVE_POLL_S:
                    if not procfs.alive(_pid_of(path)):  # died mid-pass
                        break
                    looked_alive_at = now
        return now - started

    def _rescan(self, now: float) -> None:
        """Map the live instances' files anew. NOTE: all of them, not only new names: a file
        may be a new one under an old name (a process's id reused)."""
        self._scanned_at = now
        self._unmap()
        for path in (path for directory in self._sharing.directories() for path in _live(directory, FILE_PREFIX)):
            try:
                self._maps[path] = _mapped(path, create=False)
            except (OSError, ValueError):  # gone meanwhile, or not yet its full size
                continue
        self._waited = {path: mark for path, mark in self._waited.items() if path in self._maps}

    def close(self) -> None:
        """Wait no more: no pass is marked for this decode from now on."""
        self._waiter.unlink(missing_ok=True)
        self._unmap()

    def _unmap(self) -> None:
        for marks in self._maps.values():
            marks.close()
        self._maps.clear()


def _waits(directory: Path) -> bool:
    """Whether a live decode of the server in `directory` waits for marked passes."""
    return bool(_live(directory, WAITER_PREFIX))


def _pid_of(path: Path) -> int:
    """The process a `<prefix><pid>` file is named by."""
    return int(path.name.rsplit(".", 1)[1])


def _live(directory: Path, prefix: str) -> list[Path]:
    """The files `<prefix><pid>` in `directory` whose process runs; none once the directory
    is gone (a server's is removed once its process is)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    pids = (name.removeprefix(prefix) for name in names if name.startswith(prefix))
    return [directory / f"{prefix}{pid}" for pid in pids if pid.isdigit() and procfs.alive(int(pid))]
