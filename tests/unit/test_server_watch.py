"""The watch that takes a model process down with its tritonserver (pdchat.triton.server_watch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from pdchat.triton import server_watch


def cmdline(tmp_path: Path, region: str) -> Path:
    path = tmp_path / "cmdline"
    path.write_bytes(b"\0".join([b"triton_python_backend_stub", b"model.py", region.encode(), b"1048576", b""]))
    return path


def test_the_region_named_on_the_command_line_is_removed_and_nothing_else(tmp_path):
    region = server_watch.SHM_DIR / f"pdchat_test_{uuid.uuid4().hex}"
    region.write_bytes(b"x")
    assert server_watch.remove_own_region(cmdline(tmp_path, region.name)) == region
    assert not region.exists()
    assert server_watch.remove_own_region(cmdline(tmp_path, "../etc/passwd")) is None, "a path is not a region name"
    assert server_watch.remove_own_region(cmdline(tmp_path, region.name)) is None, "already gone"


def test_a_process_whose_parent_dies_exits_and_frees_its_region(tmp_path):
    """A parent (standing in for tritonserver) starts a child that watches it; kill -9 the parent."""
    region = server_watch.SHM_DIR / f"pdchat_test_{uuid.uuid4().hex}"
    region.write_bytes(b"x")
    child = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pdchat.triton.server_watch import exit_with_server
        exit_with_server(Path({str(cmdline(tmp_path, region.name))!r}), interval_s=0.05)
        print("watching", flush=True)
        time.sleep(60)
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "watching"
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(process.stdout.readline())
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{child_pid}").exists(), "the child outlived its parent"
        assert not region.exists(), "the child left its region"
    finally:
        process.kill()
        region.unlink(missing_ok=True)
