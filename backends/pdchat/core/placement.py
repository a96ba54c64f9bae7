"""Which CPUs decode's step thread runs on alone, and which the rest of a host's pdchat takes.

decode's scheduler thread is a serving host's critical path: every stream waits for its
step. On a few cores shared with prefill, `chat`, the renderer, tritonserver and the HTTP
front, that thread loses its core whenever one of them runs, and a step takes longer
served than alone (docs/benchmarks.md). vLLM's CPU backend binds its model thread to cores
of its own for the same reason. So, by setting DECODE_CPUS:

- decode's scheduler thread binds itself to `decode` (`bind_thread`), and the torch
  threads it starts inherit them;
- every other thread of every pdchat model process (decode's own outbox and grammar
  loading included) and the HTTP fronts bind themselves to `others` (`bind_process`);
- tritonserver's own threads (gRPC, HTTP, the python backend's IPC) keep the affinity it
  was started with: start it under `taskset -c` with `others` to keep them off too.

`auto` gives decode the last CPUs this process may run on, as many as its torch threads,
when at least one is left for the rest; one CPU, or `none`: no binding at all.
No Triton import here: tested without a server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset and cpusets write it ("3", "0,2-3"); ValueError if it is none."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError("must be auto, none or a CPU list such as 3 or 2-3,6") from None
    return frozenset(cpus)


@dataclass(frozen=True)
class CpuPlacement:
    """`decode`: the CPUs of decode's scheduler thread; `others`: every other pdchat thread's."""

    decode: frozenset[int]
    others: frozenset[int]

    @staticmethod
    def resolve(wanted: frozenset[int] | str, allowed: frozenset[int], threads: int) -> CpuPlacement | None:
        """The placement DECODE_CPUS asks for (`auto`, `none`, or CPUs) among the CPUs this
        process may run on (`allowed`), decode running `threads` torch threads; None: no
        binding (none asked, or auto on a single CPU). ValueError for CPUs outside
        `allowed`, or all of them."""
        if wanted == "none":
            return None
        if wanted == "auto":
            if len(allowed) < 2:
                return None
            decode = frozenset(sorted(allowed)[-min(threads, len(allowed) - 1) :])
        else:
            assert isinstance(wanted, frozenset)
            if not wanted <= allowed:
                raise ValueError(
                    f"names CPUs {_cpu_list(wanted - allowed)}, outside this process's {_cpu_list(allowed)}"
                )
            if wanted == allowed:
                raise ValueError(f"takes every CPU this process may run on ({_cpu_list(allowed)}): leave some, or none")
            decode = wanted
        return CpuPlacement(decode, allowed - decode)

    def describe(self) -> str:
        return f"decode's step on CPUs {_cpu_list(self.decode)}, the rest on {_cpu_list(self.others)}"


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity, not the host's count)."""
    return frozenset(os.sched_getaffinity(0))


def bind_thread(cpus: frozenset[int]) -> None:
    """Run the calling thread (and the threads it starts from now on) on `cpus` only."""
    os.sched_setaffinity(0, cpus)  # Linux: 0 is the calling thread


def bind_process(cpus: frozenset[int]) -> None:
    """Run every thread of this process, and those started from them, on `cpus` only. A
    thread that ended meanwhile is skipped."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


def _cpu_list(cpus: frozenset[int]) -> str:
    """`cpus` as a CPU list ("0,2-3")."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)
