"""What /proc says of this host's processes, read the one way every caller needs: a process
that exits meanwhile reads as absent, never as an error.

NOTE: /proc is listed, not globbed for `*/stat`: pathlib's glob stats each match, and a
process that exits in between makes that stat raise ProcessLookupError, not "missing"."""

from __future__ import annotations

import os
from pathlib import Path


def pids() -> list[int]:
    """Every process's pid now."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, ...] (field 3 of proc(5)
    first); None once it exited."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, not yet reaped by its parent, does not)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def command_words(pid: int) -> list[str]:
    """The process's command line, word by word; [] once it exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
