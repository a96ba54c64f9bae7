"""A server stopped (SIGTERM) while streams are in flight through `chat`: every process of
it exits within its exit timeout plus a few seconds, and leaves no shared memory.

(Triton 2.51 does not count decoupled streams whose execute() returned as in flight: it
starts unloading at once, waits `--exit-timeout-secs` for the models still streaming,
then "exits immediately", which its own exit path may end with a SIGSEGV, or hang in it.
The launcher SIGKILLs whatever is left of the process group after its stop timeout.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from benchmarks import load
from pdchat.launcher import process_group
from tests.integration.conftest import running_server
from tests.integration.helpers import metric, wait_for

pytestmark = pytest.mark.faults

EXIT_TIMEOUT_S = 3


def test_sigterm_with_streams_in_flight_stops_every_process_in_time(tmp_path_factory, tiny_model_dir):
    server = running_server(tmp_path_factory, "shutdown", exit_timeout_s=EXIT_TIMEOUT_S)
    send = load.TritonStreams(server.grpc_url)
    body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 3000, "ignore_eos": True}
    streams = threading.Thread(target=load.run, args=(send, lambda i: body, 4, 4), daemon=True)
    streams.start()
    assert wait_for(lambda: metric(server, "pdchat_decode_active") == 4, timeout=60)
    group = server.process.pid
    started = time.monotonic()
    server.stop(timeout=EXIT_TIMEOUT_S + 7)  # SIGTERM; SIGKILL for what is left after that
    took = time.monotonic() - started
    assert process_group(group) == [], "a process of the server outlived its stop"
    assert took < EXIT_TIMEOUT_S + 7 + 5, f"stopping took {took:.1f} s"  # a bound for the check, not a speed claim
    assert server.leaked_shm() == []
    streams.join(30)
    send.close()


def test_kill_9_of_the_server_takes_its_model_processes_and_their_shm_with_it(tmp_path_factory, tiny_model_dir):
    """Triton's python-backend stubs outlive a killed tritonserver; pdchat's models watch
    for it (pdchat.triton.server_watch), free their shared memory and exit."""
    server = running_server(tmp_path_factory, "killed")
    group = server.process.pid
    assert len(process_group(group)) >= 6, "the server and its five model processes"
    os.kill(group, signal.SIGKILL)
    try:
        assert wait_for(lambda: process_group(group) == [], timeout=15), "model processes outlived their server"
        assert server.leaked_shm() == []
    finally:
        server.stop()
