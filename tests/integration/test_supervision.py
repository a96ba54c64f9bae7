"""The launcher as users run it (`pdchat pd`): a server killed with SIGKILL under load is
reported, the rest of the stack is stopped, the launcher exits 1, and no process of
the servers survives it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from pdchat.clients import load
from pdchat.launcher import free_port, process_group

READY = re.compile(r"prefill gRPC \S+ pid (\d+), decode gRPC \S+ pid (\d+), router pid (\d+)")


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_server_killed_under_load_stops_the_stack_with_a_report(victim, tiny_model_dir):
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pdchat.cli", "pd", "--model", "tiny", "--port", str(port)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in launcher.stderr:
            lines.append(line)
            if match := READY.search(line):
                break
        else:
            pytest.fail("the launcher never got ready:\n" + "".join(lines))
        pids = dict(zip(("prefill", "decode", "router"), map(int, match.groups()), strict=True))
        send = load.RouterStreams(f"http://127.0.0.1:{port}")
        body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 64, "ignore_eos": True}
        traffic = threading.Thread(target=load.run, args=(send, lambda i: body, 24, 8))
        traffic.start()
        first = send(body, abandon_after=1)  # the stack is serving
        assert first.ok, first.error
        os.kill(pids[victim], signal.SIGKILL)
        assert launcher.wait(timeout=90) == 1
        report = launcher.stderr.read()
        traffic.join(120)
        assert f"tritonserver ({victim}" in report and "was killed by SIGKILL" in report, report
        assert "exiting with status 1" in report
        for name in ("prefill", "decode"):
            assert process_group(pids[name]) == [], f"processes of the {name} server outlived the launcher"
        assert process_group(pids["router"]) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
