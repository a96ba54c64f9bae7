"""pdchat roles behind vllm-router: the deployment (fronts + router) and its benchmark.

Each pdchat server's `chat` gets `pdchat openai` (a vLLM-compatible front); vllm-router
drives P/D across them as it drives vLLM. `bench vllm-router` runs 2 prefill x 2 decode
servers behind it and streams requests through it: with both decode workers, right after
one decode server's front is killed, and once vllm-router has ejected it (req/s, TTFT
p50/p99, errors each).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import table, write_results
from pdchat.launcher import free_port, start_service


def vllm_router_command(prefill_urls: list[str], decode_urls: list[str], port: int) -> list[str]:
    """vllm-router in P/D mode over pdchat fronts, ejecting a dead worker within a second or two."""
    command = [f"{sys.prefix}/bin/vllm-router", "--vllm-pd-disaggregation", "--port", str(port)]
    command += ["--prometheus-port", str(free_port())]  # its default, 29000, is one per host
    for url in prefill_urls:
        command += ["--prefill", url]  # one URL each: a second word would be its bootstrap port
    for url in decode_urls:
        command += ["--decode", url]
    return command + [
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--worker-startup-timeout-secs",
        "60",
    ]


def stop_all(processes: list[subprocess.Popen], servers: list) -> None:
    """Stop a benchmark's helper processes (fronts, routers), then its tritonservers."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
            process.wait(10)
    for server in servers:
        server.stop()


def start_front(
    server_grpc_url: str, log_path: Path, served_model_names: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`pdchat openai` for one server (answering to `served_model_names` when given; `env`
    over this process's environment): the process and its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "pdchat.cli", "openai", "--server", server_grpc_url, "--port", str(port)]
    if served_model_names:
        command += ["--served-model-name", *served_model_names]
    return start_service(command, f"http://127.0.0.1:{port}/health", log_path, env=env), f"http://127.0.0.1:{port}"


def bench_vllm_router(args: argparse.Namespace) -> None:
    import secrets

    from benchmarks import load
    from pdchat import embedded
    from pdchat.core.settings import HANDOFF_KEY, MODEL
    from pdchat.launcher import TritonServer

    embedded.ensure_model(args.model)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = {MODEL.env: args.model, HANDOFF_KEY.env: secrets.token_hex(32)}
    roles = ["prefill", "prefill", "decode", "decode"]
    servers = [TritonServer(role=role, env=env, log_path=logs / f"{role}-{i}.log") for i, role in enumerate(roles)]
    processes: list[subprocess.Popen] = []
    try:
        print("starting 2 prefill and 2 decode servers, their fronts and vllm-router", file=sys.stderr, flush=True)
        for server in servers:
            server.start()
        fronts = [start_front(s.grpc_url, logs / f"front-{i}.log") for i, s in enumerate(servers)]
        processes += [p for p, _ in fronts]
        port = free_port()
        urls = [u for _, u in fronts]
        processes.append(
            start_service(
                vllm_router_command(urls[:2], urls[2:], port),
                f"http://127.0.0.1:{port}/health",
                logs / "vllm-router.log",
            )
        )
        send = load.RouterStreams(f"http://127.0.0.1:{port}")

        def body(i: int) -> dict:
            return {
                "model": Path(embedded.ensure_model(args.model)).name,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Request {i}: " + "tell me more " * (i % 7)}],
            }

        load.run(send, body, args.concurrency * 2, args.concurrency)  # warm-up
        phases, first_errors = {}, {}
        for phase in ("2 decode workers", "a decode front just killed", "after its ejection (3 s on)"):
            if phase == "a decode front just killed":
                fronts[3][0].kill()
                fronts[3][0].wait()
            if phase.startswith("after"):
                time.sleep(3)  # vllm-router's health check: every second, out after one failure
            started = time.perf_counter()
            outcomes = load.run(send, body, args.requests, args.concurrency)
            phases[phase] = load.summary(outcomes, time.perf_counter() - started)
            first_errors[phase] = load.first_errors(outcomes)
            print(f"  {phase}: {phases[phase]['errors']} errors {first_errors[phase][:1]}", file=sys.stderr, flush=True)
    finally:
        stop_all(processes, servers)
    columns = ["requests", "errors", "req_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"]
    print(
        f"\nvllm-router over 2 prefill x 2 decode pdchat servers ({args.model}, {args.requests} streamed requests "
        f"per phase at concurrency {args.concurrency}, {args.max_tokens} tokens each):"
    )
    print(table(["phase", *columns], [[phase, *[s[c] for c in columns]] for phase, s in phases.items()]))
    write_results(
        "vllm_router",
        {
            "model": args.model,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "phases": phases,
            "first_errors": first_errors,
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=80, help="per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--log-dir", default="/tmp/pdchat-vllm-router-bench")
