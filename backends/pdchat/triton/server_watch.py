"""A model process that outlives its tritonserver exits, freeing what it holds.

Triton 2.51's python-backend stubs do not notice their server's death: after `kill -9` of
a tritonserver its stubs (about 2 GB with pdchat's models) and their shared-memory
regions stayed for as long as anyone looked (minutes). Each pdchat model starts this
watch: once its parent is no longer the server that started it, it removes the stub's
own shm region (the third argument on the stub's command line) and exits.
No Triton import here, so it is tested without a server.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
CHECK_INTERVAL_S = 1.0
# The python backend names a stub's region <shm-region-prefix-name>_<uuid>: a plain file name.
_REGION = re.compile(r"[A-Za-z0-9_.-]+")


def exit_with_server(
    cmdline: Path = Path("/proc/self/cmdline"), interval_s: float = CHECK_INTERVAL_S
) -> threading.Thread:
    """Start the watch (a daemon thread) for this process's parent, the tritonserver."""
    server = os.getppid()

    def watch() -> None:
        while os.getppid() == server:
            time.sleep(interval_s)
        leave(cmdline)

    thread = threading.Thread(target=watch, name="pdchat-server-watch", daemon=True)
    thread.start()
    return thread


def leave(cmdline: Path = Path("/proc/self/cmdline")) -> None:
    """Exit this stub now, its shm region removed."""
    remove_own_region(cmdline)
    os._exit(1)


def leave_soon(delay_s: float = 1.0) -> None:
    """Exit this stub in `delay_s` (its last responses go out meanwhile), from a thread of its
    own: for a model whose engine died and cannot serve again. A stub gone is what pdchat's
    supervision restarts a server for (TritonServer.dead_stub); a live stub with a dead
    engine would fail every request while the server reads ready."""
    threading.Timer(delay_s, leave).start()


def remove_own_region(cmdline: Path = Path("/proc/self/cmdline")) -> Path | None:
    """Unlink the stub's shm region named on its command line; the path, if one was removed."""
    args = cmdline.read_bytes().split(b"\0")
    if len(args) < 3 or not _REGION.fullmatch(args[2].decode(errors="replace")):
        return None
    region = SHM_DIR / args[2].decode()
    try:
        region.unlink()
    except OSError:
        return None
    return region
