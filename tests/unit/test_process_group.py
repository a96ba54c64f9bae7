"""process_group: the live processes of a group, read from /proc, whatever exits meanwhile."""

import os
import subprocess
import sys

from pdchat import launcher


def test_a_group_is_its_live_processes_and_a_pid_gone_from_proc_is_skipped(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert launcher.process_group(child.pid) == [child.pid]
        listed = os.listdir("/proc")
        gone = str(max(int(name) for name in listed if name.isdigit()) + 1_000_000)  # listed, then exited
        monkeypatch.setattr(launcher.os, "listdir", lambda path: [gone, *listed])
        assert launcher.process_group(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    monkeypatch.undo()
    assert launcher.process_group(child.pid) == []
