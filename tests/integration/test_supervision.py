"""The launcher as users run it: under `pdchat pd`, a prefill server killed with SIGKILL
under load is restarted on its ports while the stack serves on, and the KV handed back to
it is swept at once; SIGTERM stops the router first, then the servers, leaving no process
and no shared memory. With --exit-on-failure (`pdchat serve`) a server whose decode stub died ends the
launcher with status 1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import load
from pdchat.core.kv.shm import FREE_PREFIX, OWNER_PREFIX, STAGING_PREFIX, kv_directory
from pdchat.launcher import SHM_DIR, free_port, process_group, python_stubs
from tests.integration.conftest import TEST_POOLS
from tests.integration.helpers import executions, wait_for

pytestmark = pytest.mark.faults

READY = re.compile(r"prefill gRPC (\S+) pid (\d+), decode gRPC \S+ pid (\d+), router pid (\d+)")
BODY = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 32, "ignore_eos": True}
KV_SWEPT_WITHIN_S = 5.0  # what survivors sweep every second must be gone by then


class Launcher:
    """`pdchat <args> --model tiny` in a process group of its own, its log read as it comes."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdchat.cli", *args, "--model", "tiny"],
            env={**os.environ, **TEST_POOLS},  # its servers inherit them
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True).start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        found = []
        if not wait_for(lambda: found.extend(re.finditer(pattern, self.log)) or found, timeout):
            pytest.fail(f"no line matching {pattern!r} in the launcher's log:\n{self.log}")
        return found[0]

    def close(self) -> None:
        """SIGTERM (the launcher stops what it started), SIGKILL if that takes too long."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def launch(tiny_model_dir):
    """Start a Launcher; stop it after the test if it still runs."""
    started: list[Launcher] = []

    def start(*args: str) -> Launcher:
        started.append(Launcher(*args))
        return started[-1]

    yield start
    for launcher in started:
        launcher.close()


def group_files(pgid: int, pattern: str) -> set[str]:
    """Names of the files that processes of a group hold open, matching `pattern`."""
    names = set()
    for pid in process_group(pgid):
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if re.search(pattern, target):
                names.add(Path(target).name)
    return names


def shm_prefix(pgid: int) -> str:
    """The server's python-backend shm prefix, from a model process's region (its third argument)."""
    for pid in process_group(pgid):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if len(args) > 2 and args[0].endswith(b"triton_python_backend_stub"):
            return "_".join(args[2].decode().split("_")[:2]) + "_"
    pytest.fail(f"no python-backend stub in process group {pgid}")


def tritonserver_on(grpc_url: str) -> int:
    """The pid of the tritonserver serving gRPC on `grpc_url`."""
    flag = f"--grpc-port={grpc_url.rsplit(':', 1)[1]}".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"tritonserver") and flag in args:
            return int(cmdline.parent.name)
    pytest.fail(f"no tritonserver on {grpc_url}")


def left_to(engines: set[str]) -> list[str]:
    """Handed-back or half-written KV files of these engines."""
    return [
        p.name
        for prefix in (FREE_PREFIX, STAGING_PREFIX)
        for engine in engines
        for p in kv_directory().glob(f"{prefix}{engine}_*")
    ]


def test_a_prefill_killed_under_load_comes_back_while_the_stack_serves_on(launch):
    port = free_port()
    launcher = launch("pd", "--port", str(port))
    ready = launcher.wait_for_line(READY.pattern, timeout=300)
    prefill_url = ready[1]
    pids = dict(zip(("prefill", "decode", "router"), map(int, ready.groups()[1:]), strict=True))
    prefixes = {name: shm_prefix(pids[name]) for name in ("prefill", "decode")}
    send = load.RouterStreams(f"http://127.0.0.1:{port}")
    stop_traffic, outcomes = threading.Event(), []

    def traffic() -> None:
        while not stop_traffic.is_set():
            started = time.monotonic()
            outcomes.append((started, send(BODY)))

    workers = [threading.Thread(target=traffic) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        assert wait_for(lambda: any(o.ok for _, o in outcomes), timeout=60), outcomes
        engines = {name[len(OWNER_PREFIX) :] for name in group_files(pids["prefill"], OWNER_PREFIX)}
        assert engines, "prefill's KV engines hold their owner locks"
        assert wait_for(lambda: left_to(engines), timeout=30), "KV is handed back to prefill under load"
        os.kill(pids["prefill"], signal.SIGKILL)
        killed = time.monotonic()

        assert wait_for(lambda: not left_to(engines), timeout=KV_SWEPT_WITHIN_S), left_to(engines)
        launcher.wait_for_line(r"restarting prefill in 1 s: restart 1 \(", timeout=30)
        assert "tritonserver (prefill" in launcher.log and "was killed by SIGKILL" in launcher.log
        assert send(BODY).ok, "while prefill is down, decode serves requests whole"
    finally:
        stop_traffic.set()  # and prefill restarts faster
        for worker in workers:
            worker.join(120)
    failed = [(started - killed, o.error) for started, o in outcomes if not o.ok]
    assert all(after < 0 for after, _ in failed), f"requests sent after the kill failed: {failed}"
    launcher.wait_for_line(r"prefill is back \(restart 1, ready \d+ s after its start\)", timeout=300)
    send = load.RouterStreams(f"http://127.0.0.1:{port}")  # new connections: the last ones idled out
    restarted = SimpleNamespace(grpc_url=prefill_url)
    assert wait_for(lambda: send(BODY).ok and executions(restarted, "prefill") > 0, timeout=30), (
        "the restarted prefill takes requests again, once the router's probe found it"
    )
    assert launcher.process.poll() is None, launcher.log

    servers = {"prefill": tritonserver_on(prefill_url), "decode": pids["decode"]}
    gone: dict[str, float] = {}

    def watch_exits() -> None:
        while len(gone) < 3:
            for name, pid in {**servers, "router": pids["router"]}.items():
                if name not in gone and not process_group(pid):
                    gone[name] = time.monotonic()
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_exits, daemon=True)
    watcher.start()
    launcher.process.send_signal(signal.SIGTERM)
    assert launcher.process.wait(timeout=120) == 0, launcher.log
    watcher.join(5)
    assert set(gone) == {"prefill", "decode", "router"}, "a process outlived the launcher"
    assert gone["router"] < min(gone["prefill"], gone["decode"]), f"the router stops first: {gone}"
    for name, prefix in prefixes.items():
        assert list(SHM_DIR.glob(f"{prefix}*")) == [], f"the {name} server left shared memory"


def test_with_exit_on_failure_a_dead_decode_stub_ends_the_launcher_with_status_1(launch):
    """A server whose decode stub died still answers ready, and fails every chat request:
    the launcher counts it as dead (a dead tritonserver is seen as in the restart test above)."""
    ports = [f"--{name}-port={free_port()}" for name in ("http", "grpc", "metrics")]
    launcher = launch("serve", "--exit-on-failure", *ports)
    pid = int(launcher.wait_for_line(r"ready: .*, pid (\d+);", timeout=300)[1])
    [stub] = [stub for stub, (model, _) in python_stubs(pid).items() if model == "decode"]
    os.kill(stub, signal.SIGKILL)
    assert launcher.process.wait(timeout=60) == 1
    launcher.wait_for_line("exiting with status 1", timeout=5)
    assert "the python stub of decode_0_0 in tritonserver (monolithic, gRPC" in launcher.log
    assert "died; the server stays up, failing every request to that model" in launcher.log
    assert "restarting" not in launcher.log
    assert process_group(pid) == [], "processes of the server outlived the launcher"
