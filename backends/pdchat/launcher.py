"""Start a real tritonserver for one role: the binary on PATH, else the nvidia-pytriton one.

The pytriton wheel ships tritonserver, the python backend and one stub per Python
version; we assemble them into a backend directory once, set what the stub needs
(its libraries, this venv first on PATH), pick free ports, wait for readiness, and
stop with SIGTERM so the python backend removes its shared-memory regions. A server or
router started here can be started again on the same ports once it died: each is a
`pdchat.supervisor.Child`.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdchat.core import procfs, settings
from pdchat.core.settings import cache_dir
from pdchat.registry import MONOLITHIC, PREFILL, ROLES, SHM

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SHM_DIR = Path("/dev/shm")
# A stopping router has its drain timeout (settings.DRAIN_TIMEOUT_S) to finish its streams,
# then this long to close its connections and exit.
ROUTER_EXIT_MARGIN_S = 10.0


class ServerError(RuntimeError):
    """tritonserver could not be started or did not become ready."""


LOWEST_PORT = 10000  # free_port's range begins here and ends below the kernel's ephemeral ports


def free_port(port_range: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """A TCP port free on loopback now, below the kernel's ephemeral range.

    NOTE: a server binds its port long after it is chosen (tritonserver its metrics port once
    every model loaded), while other processes (vLLM's engines, UCX) bind port 0 meanwhile. A
    port of the ephemeral range could be handed to one of them; a port below it never is."""
    try:
        ephemeral = int(port_range.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    for _ in range(100):
        port = random.randrange(LOWEST_PORT, max(ephemeral, LOWEST_PORT + 1000))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    raise ServerError(f"no free TCP port found between {LOWEST_PORT} and {ephemeral}")


def _pytriton_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed")
    return Path(spec.submodule_search_locations[0])


def find_tritonserver() -> tuple[Path, Path | None, Path | None]:
    """(binary, backend directory or None for the binary's own, extra library dir or None)."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path), None, None
    root = _pytriton_root()
    return root / "tritonserver/bin/tritonserver", assemble_backend_dir(root), root.parent / "nvidia_pytriton.libs"


def assemble_backend_dir(pytriton_root: Path) -> Path:
    """python/{libtriton_python.so, triton_python_backend_utils.py, stub for this Python},
    copied from the wheel once (again where a file's size differs).

    NOTE: servers started together call this at once, from threads or processes: each
    copies to a temporary name of its own and renames it into place, so none sees a
    partial file and none removes another's temporary."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = cache_dir() / "backends" / f"py{version}"
    python_dir = target / "python"
    sources = {
        "libtriton_python.so": pytriton_root / "tritonserver/backends/python/libtriton_python.so",
        "triton_python_backend_utils.py": pytriton_root / "tritonserver/backends/python/triton_python_backend_utils.py",
        "triton_python_backend_stub": pytriton_root
        / f"tritonserver/python_backend_stubs/{version}/triton_python_backend_stub",
    }
    python_dir.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        if not source.exists():
            raise ServerError(f"the pytriton wheel lacks {source} (Python {version} unsupported?)")
        dest = python_dir / name
        if not dest.exists() or dest.stat().st_size != source.stat().st_size:
            temporary = dest.with_name(f"{name}.tmp{os.getpid()}-{threading.get_ident()}")
            shutil.copy2(source, temporary)
            temporary.replace(dest)
    return target


def answers(url: str) -> bool:
    """Whether `url` answers 200 now."""
    return http_status(url) == 200


def http_status(url: str) -> int | None:
    """The HTTP status `url` answers a GET with now; None for no answer within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, what: str, log_path: Path | None) -> None:
    """Poll `url` until it answers 200; fail early if `process` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"{what} exited with code {process.returncode} during start; its log: {log_path}")
        if answers(url):
            return
        time.sleep(0.25)
    raise ServerError(f"{what} not ready after {timeout:.0f} s; its log: {log_path}")


@dataclass
class Service:
    """A helper process (a front, a router) in its own process group, ready once
    `health_url` answers 200."""

    name: str
    command: list[str]
    health_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment
    process: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Start the process (its log appended to), without waiting for it."""
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start(self, timeout: float = 120.0) -> Service:
        self.spawn()
        try:
            wait_healthy(self.process, self.health_url, timeout, self.name, self.log_path)
        except BaseException:
            self.reap()
            raise
        return self

    def is_ready(self) -> bool:
        return answers(self.health_url)

    def progress(self) -> str:
        return ""

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def exit_report(self) -> str:
        return describe_exit(f"{self.name} ({self.health_url})", self.process, self.log_path)

    def reap(self) -> None:
        """SIGKILL whatever is left of its process group, and wait for the process."""
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, `timeout` seconds to exit, then SIGKILL."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.reap()


def start_service(
    command: list[str], health_url: str, log_path: Path, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A helper process (a front, a router) in its own process group, once `health_url`
    answers; `env` over this process's environment."""
    return Service(Path(command[0]).name, command, health_url, log_path, env or {}).start(timeout).process


def _stub_library_dirs() -> list[Path]:
    """This interpreter's libpython first: a distro libpython of the same minor version
    would otherwise load and break this interpreter's extension modules (e.g. _ssl)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlibrary = sysconfig.get_config_var("INSTSONAME") or ""
    if libdir and ldlibrary and (Path(libdir) / ldlibrary).exists():
        return [Path(libdir)]
    return []


# Computed once at import: sysconfig fills its variables lazily and not thread-safely
# before Python 3.12, so servers started from threads could see no LIBDIR.
STUB_LIBRARY_DIRS = _stub_library_dirs()


def stub_environment(libs: Path | None, env: dict[str, str], python: Path | None = None) -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH for tritonserver's python stub: it runs the first python3 on
    PATH (make it `python`'s venv's, by default this one's), and must load this interpreter's
    libpython, not a distro one (a venv made from the same Python shares it)."""
    return {
        "PATH": f"{(python or Path(sys.executable)).parent}{os.pathsep}{env.get('PATH', '')}",
        "LD_LIBRARY_PATH": os.pathsep.join(str(p) for p in (*STUB_LIBRARY_DIRS, libs, env.get("LD_LIBRARY_PATH")) if p),
    }


def vllm_python(env: dict[str, str]) -> Path:
    """The python that runs a server's models with engine vllm (setting VLLM_VENV): that venv's,
    else the checkout's .venv-vllm (scripts/bootstrap.sh --vllm) where it exists, else this one."""
    venv = settings.VLLM_VENV.get({}, env)
    if venv:
        return Path(venv).expanduser() / "bin" / "python3"
    built = REPO_ROOT / ".venv-vllm" / "bin" / "python3"
    return built if built.exists() else Path(sys.executable)


def stock_command() -> str:
    """Shell lines that run a stock `tritonserver` on the model repository as the launcher
    does: the exports the python stub needs, and the binary with its backend directory."""
    import shlex

    binary, backend_dir, libs = find_tritonserver()
    exports = stub_environment(libs, {"PATH": "$PATH", "LD_LIBRARY_PATH": "$LD_LIBRARY_PATH"})
    lines = [f'export {name}="{value}"' for name, value in exports.items()]
    backend = f" --backend-directory={shlex.quote(str(backend_dir))}" if backend_dir is not None else ""
    lines.append(
        f"{shlex.quote(str(binary))} --model-repository={shlex.quote(str(DEFAULT_MODEL_REPOSITORY))}{backend}"
        " [--model-config-name prefill|decode]"
    )
    return "\n".join(lines)


@dataclass
class TritonServer:
    """One tritonserver process serving the model repository in a role."""

    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    role: str = MONOLITHIC
    env: dict[str, str] = field(default_factory=dict)
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    host: str = "127.0.0.1"
    # Explicit model control: load only these at start; others via the repository API.
    load_models: tuple[str, ...] | None = None
    log_path: Path | None = None
    extra_args: tuple[str, ...] = ()
    # How long a stopping server lets requests in flight finish before it unloads its
    # models anyway (Triton's default, 30 s, makes a stop under load look like a hang).
    exit_timeout_s: int = 10
    # Run inside this network namespace (`ip netns exec`): a host of its own, for tests
    # that cross a network on one machine.
    netns: str | None = None
    process: subprocess.Popen | None = None
    shm_prefix: str = field(default_factory=lambda: f"pdchat_{uuid.uuid4().hex[:8]}_")
    log_offset: int = 0  # where the log of the latest start begins
    # The python stubs of its models once ready, by pid: (model, instance). Triton neither
    # restarts a stub that died nor stops being ready: every request to its model fails.
    stubs: dict[int, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model_repository = Path(self.model_repository)
        self.log_path = None if self.log_path is None else Path(self.log_path)

    @property
    def name(self) -> str:
        return self.role

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> tuple[list[str], dict[str, str]]:
        if self.role not in ROLES:
            raise ServerError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        binary, backend_dir, libs = find_tritonserver()
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        args = [
            *(["ip", "netns", "exec", self.netns] if self.netns else []),
            str(binary),
            f"--model-repository={self.model_repository}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--log-info=true",
        ]
        if backend_dir is not None:
            args.append(f"--backend-directory={backend_dir}")
        if self.role != MONOLITHIC:
            args.append(f"--model-config-name={self.role}")
        env = {**os.environ, **self.env}
        vllm = settings.ENGINE.get({}, env) == "vllm"
        load_models = self.load_models
        if vllm:  # the one engine the role uses, with vLLM's KV connector only in a P/D pair
            load_models = load_models or ("chat", "renderer", "prefill" if self.role == PREFILL else "decode")
            if self.role == MONOLITHIC:
                env.setdefault(settings.VLLM_KV_CONNECTOR.env, "false")
        if load_models is not None:
            args += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in load_models)]
        args += list(self.extra_args)
        return args, {**env, **stub_environment(libs, env, vllm_python(env) if vllm else None)}

    def spawn(self) -> None:
        """Start tritonserver on this server's ports (chosen at the first start, kept for
        a restart), without waiting for it."""
        args, env = self.command()
        self.stubs = {}
        if self.log_path is None:
            self.log_path = cache_dir() / "logs" / f"tritonserver-{self.role}-{self.http_port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            # Own process group: signals reach tritonserver and its stubs, not our caller.
            self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)  # a launcher that exits on an exception takes its server along

    def start(self, timeout: float = 300.0) -> TritonServer:
        """Start it and wait until it is ready; raise ServerError if it is not.

        NOTE: a server killed by a signal while it starts is started once more, on the same
        ports, and only once. Triton 2.51's python backend rarely loses a stub as instances
        initialize, and the server then aborts on the stub's mutex
        (docs/notes/python-backend-concurrency.md); a server that exits (a model failed to
        load) or does not get ready in time is not tried again."""
        deadline = time.monotonic() + timeout
        self.spawn()
        try:
            try:
                self.wait_ready(timeout)
            except ServerError:
                if self.process.poll() is None or self.process.returncode >= 0:
                    raise
                print(
                    f"[pdchat] {describe_exit(self._what, self.process, self.log_path, lines=5)}\n"
                    "[pdchat] starting it once more",
                    file=sys.stderr,
                    flush=True,
                )
                self.reap()
                self.spawn()
                self.wait_ready(max(deadline - time.monotonic(), 1.0))
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def ready_url(self) -> str:
        return f"http://{self.http_url}/v2/health/ready"

    def wait_ready(self, timeout: float) -> None:
        """Until the server is ready and its metrics endpoint answers: tritonserver starts
        the metrics service last, tens of milliseconds after it reports ready, and the
        callers (the supervisor, the tests, the benchmarks) read it from the start."""
        deadline = time.monotonic() + timeout
        wait_healthy(self.process, self.ready_url, timeout, "tritonserver", self.log_path)
        left = max(deadline - time.monotonic(), 1.0)
        wait_healthy(self.process, self.metrics_url, left, "tritonserver's metrics endpoint", self.log_path)
        self.stubs = python_stubs(self.process.pid)

    def is_ready(self) -> bool:
        ready = answers(self.ready_url)
        if ready and not self.stubs and self.process is not None:  # ready after a restart: watch the new stubs
            self.stubs = python_stubs(self.process.pid)
        return ready

    def dead_stub(self) -> str | None:
        """The instance (e.g. 'decode_0_0') whose python stub died while its model is still
        loaded, if one did. A stub gone with its model (unloaded, reloaded) is forgotten; one
        whose model's readiness the server does not tell now (busy, stopped) is looked at again."""
        for pid, (model, instance) in list(self.stubs.items()):
            if procfs.alive(pid):
                continue
            now = python_stubs(self.process.pid)
            if instance in {name for _, name in now.values()}:  # its model was reloaded
                del self.stubs[pid]
                self.stubs.update({p: stub for p, stub in now.items() if stub[1] == instance})
                continue
            ready = http_status(f"http://{self.http_url}/v2/models/{model}/ready")
            if ready == 200:
                return instance  # NOTE: kept in `stubs`, so that every look reports it
            if ready is not None:  # the server says its model is not ready: unloaded
                del self.stubs[pid]
        return None

    def progress(self) -> str:
        """Which models the latest start loaded, is loading, failed: 'loaded renderer, chat;
        loading prefill, decode', from its log (its HTTP API answers only once all are loaded)."""
        return model_progress(_read_from(self.log_path, self.log_offset))

    def exited(self) -> bool:
        """Whether it exited, or a stub of a model it still serves died (it then fails every
        request to that model: as good as gone)."""
        if self.process is None:
            return False
        return self.process.poll() is not None or self.dead_stub() is not None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the python backend then cleans its shm), SIGKILL if it hangs; then reap."""
        atexit.unregister(self.stop)
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.reap()

    def reap(self) -> None:
        """SIGKILL whatever is left of its process group (stubs of a server that died) and
        wait for it to go; then remove the shm regions and the shm KV it left."""
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 10  # SIGKILL is delivered, not yet done: wait for the stubs to go
        while process_group(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.cleanup_shm()
        sweep_dead_kv()

    def memory(self) -> dict[int, int]:
        """RSS of tritonserver and each of its stubs, by pid (it leads its own process group)."""
        return resident_bytes(process_group(self.process.pid))

    def exit_report(self) -> str:
        """Why the server exited, with the end of its log (for a supervisor's message)."""
        if self.process.poll() is None and (instance := self.dead_stub()) is not None:
            how = "died; the server stays up, failing every request to that model"
            return describe_exit(f"the python stub of {instance} in {self._what}", self.process, self.log_path, how=how)
        return describe_exit(self._what, self.process, self.log_path)

    @property
    def _what(self) -> str:
        return f"tritonserver ({self.role}, gRPC {self.grpc_url})"

    def leaked_shm(self) -> list[Path]:
        """Shared-memory regions of this server (none once it has stopped cleanly)."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def cleanup_shm(self) -> None:
        """Remove regions a killed server could not clean itself."""
        for path in self.leaked_shm():
            path.unlink(missing_ok=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


_LOADING = re.compile(r'"loading: ([\w.-]+):\d+"')
_LOADED = re.compile(r"\"successfully loaded '([\w.-]+)'\"")
_FAILED = re.compile(r"\"failed to load '([\w.-]+)'")


def model_progress(log: str) -> str:
    """The models a tritonserver log shows loaded, loading and failed, in the order it began them."""
    started = list(dict.fromkeys(_LOADING.findall(log)))
    loaded, failed = set(_LOADED.findall(log)), set(_FAILED.findall(log))
    parts = [
        f"{what} {', '.join(names)}"
        for what, names in (
            ("loaded", [m for m in started if m in loaded]),
            ("loading", [m for m in started if m not in loaded | failed]),
            ("failed", [m for m in started if m in failed]),
        )
        if names
    ]
    return "; ".join(parts) or "no model loading yet"


def _read_from(path: Path | None, offset: int, limit: int = 4 << 20) -> str:
    """The text of `path` from `offset` (at most `limit` bytes of it); "" if there is none."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            return log.read(limit).decode("utf-8", "replace")
    except (OSError, TypeError):
        return ""


def process_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group: a server's are tritonserver and its stubs."""
    pids = []
    for pid in procfs.pids():
        fields = procfs.stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(pid)
    return pids


def python_stubs(pgid: int) -> dict[int, tuple[str, str]]:
    """The python backend stubs in a server's process group, by pid: (model, instance)."""
    stubs = {}
    for pid in process_group(pgid):
        words = procfs.command_words(pid)
        if not words or not words[0].endswith("triton_python_backend_stub"):
            continue
        model = next((Path(w).parent.parent.name for w in words if w.endswith("/model.py")), "")
        instance = next((w for w in words if model and re.fullmatch(re.escape(model) + r"_\d+_\d+", w)), model)
        stubs[pid] = (model, instance)
    return stubs


def resident_bytes(pids: list[int]) -> dict[int, int]:
    """RSS of each process still alive, by pid."""
    page = os.sysconf("SC_PAGE_SIZE")
    rss = {}
    for pid in pids:
        try:
            rss[pid] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except OSError:
            continue
    return rss


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # nothing left of it
        pass


def sweep_dead_kv() -> None:
    """Free the shm KV files of engines whose process is gone, and expired ones
    (`pdchat.core.kv.shm.sweep_directory`), in this user's KV directory if there is one."""
    from pdchat.core.kv.shm import kv_directory, sweep_directory

    if kv_directory().is_dir():
        sweep_directory()


def describe_exit(
    what: str, process: subprocess.Popen, log_path: Path | None, lines: int = 15, how: str | None = None
) -> str:
    """'X was killed by SIGKILL' or 'X exited with code N' (or 'X <how>'), then its log's last lines."""
    code = process.returncode
    if how is None:
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
    tail = ""
    if log_path is not None and log_path.exists():
        with open(log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
            tail = "\n".join(log.read().decode("utf-8", "replace").splitlines()[-lines:])
    return f"{what} {how}; the end of its log ({log_path}):\n{tail}"


@dataclass
class PDStack:
    """A P/D deployment on loopback: prefill server, decode server, router process.

    One generated handoff key is shared by both servers; the router serves the
    OpenAI-compatible API on `router_url`. `children()` are what a supervisor restarts.
    """

    model: str = "smollm2"
    connector: str = SHM
    router_port: int = 0
    served_model_names: tuple[str, ...] = ()  # both servers' and the router's (empty: the model's name)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    prefill: TritonServer | None = None
    decode: TritonServer | None = None
    front: Service | None = None  # the router process
    handoff_key: str = ""  # generated at start unless given

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def router(self) -> subprocess.Popen | None:
        return None if self.front is None else self.front.process

    @property
    def router_log(self) -> Path | None:
        return None if self.front is None else self.front.log_path

    def start(self, timeout: float = 300.0) -> PDStack:
        import secrets

        log_dir = Path(self.log_dir or cache_dir() / "logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.handoff_key = self.handoff_key or secrets.token_hex(32)
        env = {
            settings.MODEL.env: self.model,
            settings.HANDOFF_KEY.env: self.handoff_key,
            settings.KV_CONNECTOR.env: self.connector,
            **({settings.SERVED_MODEL_NAME.env: ",".join(self.served_model_names)} if self.served_model_names else {}),
            **self.env,
        }
        self.prefill = TritonServer(role="prefill", env=env, log_path=log_dir / "prefill.log")
        self.decode = TritonServer(role="decode", env=env, log_path=log_dir / "decode.log")
        errors = each_in_a_thread([lambda s=s: s.start(timeout) for s in (self.prefill, self.decode)])
        if errors:
            self.stop()
            raise errors[0]
        self.start_router(log_dir / "router.log", timeout)
        return self

    def start_router(self, log_path: Path, timeout: float = 60.0) -> None:
        """(Re)start the router process against the two servers."""
        self.router_port = self.router_port or free_port()
        command = [
            sys.executable,
            "-m",
            "pdchat.cli",
            "router",
            "--port",
            str(self.router_port),
            "--prefill",
            self.prefill.grpc_url,
            "--decode",
            self.decode.grpc_url,
            *(["--served-model-name", *self.served_model_names] if self.served_model_names else []),
        ]
        self.front = Service("router", command, f"{self.router_url}/health", log_path, env=self.env).start(timeout)

    def processes(self) -> dict[str, subprocess.Popen]:
        return {"prefill": self.prefill.process, "decode": self.decode.process, "router": self.router}

    def children(self) -> list[TritonServer | Service]:
        return [self.prefill, self.decode, self.front]

    def stop_router(self) -> None:
        """SIGTERM: the router drains its streams within its drain timeout (it inherits this
        process's environment, so this reads the same one), then exits."""
        if self.front is not None:
            self.front.stop(settings.DRAIN_TIMEOUT_S.get() + ROUTER_EXIT_MARGIN_S)

    def stop(self) -> None:
        """The router first, so no stream is cut by a server going away, then both servers at once."""
        self.stop_router()
        errors = each_in_a_thread([server.stop for server in (self.prefill, self.decode) if server is not None])
        if errors:
            raise errors[0]

    def __enter__(self) -> PDStack:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def each_in_a_thread(calls: list[Callable[[], object]]) -> list[BaseException]:
    """Make the calls at once, a thread each; return what they raised, once all are done."""
    errors: list[BaseException] = []

    def call(function: Callable[[], object]) -> None:
        try:
            function()
        except BaseException as exc:  # noqa: BLE001 - returned
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(function,)) for function in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
