"""How many torch threads a prompt's pass takes: more while no other process uses the cores.

A stage model runs on `torch_threads` threads (TORCH_THREADS: half the cores by default), so
that prefill and decode, sharing a server's cores, do not spin their OpenMP threads against
each other. But a lone prompt (a quiet server, concurrency 1) leaves the other cores idle
while its pass runs, and that pass is most of its first token's time. So before each pass
prefill looks at how much of its cores sat free since the pass before: idle (`/proc/stat`),
or running its own threads beyond its `base` cores (`/proc/self/stat`), and takes one more
thread per free core, up to `most` (IDLE_CORE of a core counts as one: at concurrency 1
decode streams the answer before on the other core meanwhile). Under load the other
processes (decode) keep the cores busy and a pass keeps its threads; a burst of prompts
beside an idle decode keeps every core, pass after pass. NOTE: its own ticks count: a pass
that took every core left none idle, and counting idle ticks alone gave the next pass
`base` threads, every other pass of a burst on half the cores.

Decode prefills a lone prompt itself only while the server is idle
(local_prefill_when_idle): its chunks take `most` while no row runs, without looking
(`watch_cores=False`), and its steps keep `base`.

The pass's numbers do not change with its threads: oneDNN's GEMMs and the attention (the
C kernels' or torch's) split their work by rows and heads, never a sum (tests/unit/test_pass_threads.py checks the
logits bit for bit). No Triton import here: tested without a server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pdchat.core import procfs

if TYPE_CHECKING:
    from pdchat.core.generation.engine import CausalLM

# /proc/stat's time columns after the name: user nice system idle iowait irq softirq steal
# (guest time is inside user already).
_IDLE_COLUMNS = (3, 4)
_COUNTED_COLUMNS = 8


def read_proc_stat(path: str = "/proc/stat") -> str:
    with open(path) as stat:
        return stat.read()


def own_ticks() -> int:
    """This process's CPU time so far (user and system), in /proc/stat's clock ticks."""
    fields = procfs.stat_fields(os.getpid())
    return int(fields[11]) + int(fields[12]) if fields is not None else 0  # utime, stime (proc(5) 14, 15)


def cpu_times(stat: str, cpus: Iterable[int]) -> tuple[int, int]:
    """(idle, total) clock ticks summed over `cpus` from /proc/stat's text; (0, 0) if none is listed."""
    wanted = {f"cpu{cpu}" for cpu in cpus}
    idle = total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            ticks = [int(field) for field in rest.split()[:_COUNTED_COLUMNS]]
            idle += sum(ticks[column] for column in _IDLE_COLUMNS)
            total += sum(ticks)
    return idle, total


class IdleCores:
    """How many of `cpus` sat free, on average, since the last `since_last()`: idle, or
    running this process beyond `own_base` cores (`own`: its CPU ticks so far).

    NOTE: the first call has no window before it and says 0 (nothing known to be free), as
    does a host without /proc/stat."""

    def __init__(
        self,
        cpus: Iterable[int],
        read: Callable[[], str] = read_proc_stat,
        own: Callable[[], int] = own_ticks,
        own_base: int = 0,
    ):
        self._cpus, self._read, self._own, self._own_base = frozenset(cpus), read, own, own_base
        self._last: tuple[int, int, int] | None = None

    def since_last(self) -> float:
        try:
            idle, total = cpu_times(self._read(), self._cpus)
            now = (idle, total, self._own())
        except (OSError, ValueError):
            return 0.0
        last, self._last = self._last, now
        if last is None or now[1] <= last[1]:
            return 0.0
        cores, ticks = len(self._cpus), now[1] - last[1]
        idle, own = cores * (now[0] - last[0]) / ticks, cores * (now[2] - last[2]) / ticks
        return min(float(cores), idle + max(0.0, own - self._own_base))


class _AllIdle:
    """IdleCores' answer for a caller that knows its cores idle: all of them."""

    def __init__(self, cores: int):
        self._cores = cores

    def since_last(self) -> float:
        return float(self._cores)


# The share of a core that must have sat idle to count as one: at concurrency 1 on 2 cores
# 0.64-0.81 of a core sits idle between passes, at 4 up to 0.55, at 16 about 0.1.
IDLE_CORE = 0.6


def idle_whole_cores(cores: float) -> int:
    """`cores` idle on average as whole cores, IDLE_CORE of one counting as one."""
    return int(cores + 1 - IDLE_CORE)


class PassThreads:
    """The torch threads for each pass: `base`, plus one per core free since the pass before
    (IdleCores; IDLE_CORE of a core counts as one), at most `most`; set through
    `set_threads` (the engine's: torch's and its C kernels') on the thread that runs the
    passes, only when it changes.

    `min_window_s`: passes closer together than this (a long prompt's chunks) keep the
    count the first of them took."""

    def __init__(
        self,
        base: int,
        most: int,
        idle: IdleCores,
        set_threads: Callable[[int], None],
        min_window_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base, self.most = base, max(base, most)
        self._idle, self._set_threads, self._min_window_s, self._clock = idle, set_threads, min_window_s, clock
        self.current = base
        self._decided_at: float | None = None

    @classmethod
    def for_engine(cls, engine: CausalLM, most: int, *, watch_cores: bool = True) -> PassThreads:
        """torch's threads now (the stage's) as `base`, over the cores this process may run
        on (its affinity), set through `engine.set_threads` (torch's and its C kernels'); on
        CPU only (elsewhere `most` is `base`). `watch_cores=False`: every pass takes `most`,
        for a caller that passes only when it knows the host idle (decode's prefill of a
        lone prompt: /proc/stat's window since its pass before holds the answer it streamed)."""
        import torch

        base = torch.get_num_threads()
        most = most if engine.device == "cpu" else base
        cpus = os.sched_getaffinity(0)
        idle = IdleCores(cpus, own_base=base) if watch_cores else _AllIdle(len(cpus))
        return cls(base, most, idle, engine.set_threads)

    def before_pass(self) -> int:
        """The threads the next pass takes (set now if they changed)."""
        if self.most == self.base:
            return self.base
        now = self._clock()
        if self._decided_at is not None and now - self._decided_at < self._min_window_s:
            return self.current
        self._decided_at = now
        threads = min(self.most, self.base + idle_whole_cores(self._idle.since_last()))
        return self._take(threads)

    def take_most(self) -> int:
        """`most` threads for the next pass, whatever the cores did (a pass that decode waits
        for: setting prefill_takes_cores_ms); set now if they changed. The caller calls
        `after_most()` once the pass ended."""
        return self._take(self.most)

    def after_most(self) -> None:
        """A pass on `most` threads ended: the next window starts now. NOTE: the pass's own
        ticks are not free cores: a short pass after it, not waited for, would take `most`
        beside decode's steps."""
        self._idle.since_last()
        self._decided_at = None

    def at_base(self) -> None:
        """Back to `base` threads (set now if the last pass took more)."""
        self._take(self.base)

    def _take(self, threads: int) -> int:
        if threads != self.current:
            self._set_threads(threads)
            self.current = threads
        return threads
