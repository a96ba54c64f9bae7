"""Benchmarks that print tables and write plots (never timed assertions in tests).

    python -m pdchat.clients.bench reuse    # decode's render cost vs the gate's check
    python -m pdchat.clients.bench kv       # KV transfer throughput per connector
    python -m pdchat.clients.bench router   # latency the router adds per request
    python -m pdchat.clients.bench soak     # N streams at concurrency C through a P/D pair

Ratios are measured side by side in one run; these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

OUT_DIR = Path("bench-results")


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(name: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]], logx: bool = False) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    OUT_DIR.mkdir(exist_ok=True)
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        axis.plot(xs, ys, marker="o", label=label)
    if logx:
        axis.set_xscale("log")
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(OUT_DIR / f"{name}.png", dpi=120)
    print(f"plot: {OUT_DIR / f'{name}.png'}")


def bench_reuse(args: argparse.Namespace) -> None:
    """What decode skips: rendering + tokenizing the conversation, against checking the
    signed handoff (signature, fingerprint, ids), at growing prompt lengths."""
    from pdchat import embedded
    from pdchat.core.handoff import Gate, Policy, render_fingerprint, sign
    from pdchat.core.protocol import parse_chat_json
    from pdchat.core.rendering import ChatRenderer

    model_dir = embedded.ensure_model(args.model)
    renderer = ChatRenderer(model_dir, model_dir.name)
    key = b"k" * 32
    gate = Gate(Policy.SIGNED, key, vocab_size=len(renderer.tokenizer), context_length=1 << 20)
    rows, xs, render_ms, gate_ms = [], [], [], []
    paragraph = "The committee reviewed the quarterly figures, naïve café notes ☕ and all; "
    for target in args.tokens:
        per = len(renderer.tokenizer.encode(paragraph))
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": paragraph * max(1, target // per // 4)} for i in range(3)]
        turns.append({"role": "user", "content": paragraph * max(1, target // per // 4)})
        body = json.dumps({"messages": [{"role": "system", "content": "Be brief."}, *turns]})
        request = parse_chat_json(body)
        ids = renderer.token_ids(request)
        params = sign(key, ids, render_fingerprint(request, model_dir.name))

        def render(body=body):
            renderer.token_ids(parse_chat_json(body))

        def admit(body=body, ids=ids, params=params):
            gate.admit(ids, params, render_fingerprint(parse_chat_json(body), model_dir.name))

        print(f"  {len(ids)} tokens ...", file=sys.stderr, flush=True)
        r = statistics.median(timed(render, args.repeats)) * 1000
        g = statistics.median(timed(admit, args.repeats)) * 1000
        rows.append([len(ids), r, r / len(ids) * 1000, g, r - g, r / g])
        xs.append(len(ids))
        render_ms.append(r)
        gate_ms.append(g)
    print(f"\nDecode critical path per request, model {model_dir.name} (median of {args.repeats}):")
    print(table(["prompt tokens", "render+tokenize ms", "ms per 1k tok", "gate check ms", "saved ms", "ratio"], rows))
    plot("reuse", "Decode: re-render vs checking forwarded ids", "prompt tokens", "ms (median)",
         {"render + tokenize (naive decode)": (xs, render_ms), "signed-id gate (pdchat)": (xs, gate_ms)}, logx=True)


def _pull_worker(connection, connector_name: str) -> None:
    from pdchat.core.kv_transfer import make_connector

    connector = make_connector(connector_name)
    while True:
        handle = connection.recv()
        if handle is None:
            break
        kv = connector.pull(handle)
        last = float(kv.reshape(-1)[-1])  # touches the last page
        del kv
        connector.done(handle)  # as decode does after its first step
        connection.send(last)
    connector.close()


def bench_kv(args: argparse.Namespace) -> None:
    """Publish in this process, pull in another, per connector and size."""
    from pdchat.core.kv_transfer import make_connector

    rows, series = [], {}
    for name in args.connectors:
        try:
            publisher = make_connector(name, budget_bytes=1 << 31)
        except Exception as exc:  # noqa: BLE001 - a missing engine is reported, not fatal
            print(f"{name}: unavailable ({exc})")
            continue
        parent, child = multiprocessing.Pipe()
        worker = multiprocessing.get_context("spawn").Process(target=_pull_worker, args=(child, name), daemon=True)
        worker.start()
        sizes, rates = [], []
        for mib in args.sizes:
            kv = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 4, dtype=np.float32)

            def transfer(kv=kv, publisher=publisher, parent=parent):
                parent.send(publisher.publish(kv))
                assert parent.recv() == float(kv[-1])

            transfer()  # warm-up: connection setup, first-touch pages
            samples = timed(transfer, args.repeats)
            median, best = mib / 1024 / statistics.median(samples), mib / 1024 / min(samples)
            rows.append([name, mib, statistics.median(samples) * 1000, median, best])
            sizes.append(mib)
            rates.append(median)
            print(f"  {name} {mib} MiB: {median:.2f} GB/s", file=sys.stderr, flush=True)
        parent.send(None)
        worker.join(30)
        publisher.close()
        series[name] = (sizes, rates)
    print(f"\nKV transfer, publish in one process -> pull in another (median of {args.repeats}):")
    print(table(["connector", "MiB", "ms", "GB/s (median)", "GB/s (best)"], rows))
    plot("kv_transfer", "KV transfer between processes", "KV size (MiB)", "GB/s (median)", series, logx=True)


def bench_router(args: argparse.Namespace) -> None:
    """The same P/D requests driven directly (two gRPC legs) and through the router."""
    import urllib.request

    from pdchat.clients.chat import GrpcChat, chat_inputs, collect
    from pdchat.launcher import PDStack

    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}
    with PDStack(model=args.model) as stack:
        prefill, decode = GrpcChat(stack.prefill.grpc_url), GrpcChat(stack.decode.grpc_url)

        def direct():
            [handed] = list(prefill.stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
            collect(decode.stream(chat_inputs(body, prompt_token_ids=handed.prompt_token_ids,
                                              kv_transfer_params=handed.kv_transfer_params)))

        def routed():
            request = urllib.request.Request(f"{stack.router_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request).read()

        for warm in (direct, routed):
            warm()
        pairs = [(timed(direct, 1)[0], timed(routed, 1)[0]) for _ in range(args.repeats)]  # interleaved
        prefill.close()
        decode.close()
    direct_ms = statistics.median(p[0] for p in pairs) * 1000
    routed_ms = statistics.median(p[1] for p in pairs) * 1000
    print(f"\nOne-token P/D request, {args.model}, median of {args.repeats} interleaved pairs:")
    print(table(["path", "ms"], [["two gRPC legs, no router", direct_ms], ["through the router (HTTP)", routed_ms],
                                  ["router adds", routed_ms - direct_ms]]))


def bench_soak(args: argparse.Namespace) -> None:
    """Streamed requests through the router of a P/D pair: rate, TTFT, latency, errors, and
    each server process's memory after warm-up and at the end."""
    from pdchat import embedded
    from pdchat.clients import load
    from pdchat.launcher import PDStack

    embedded.ensure_model(args.model)

    def body(i: int) -> dict:
        return {"messages": [{"role": "user", "content": f"Request {i}: " + "tell me more " * (i % 7)}],
                "max_tokens": args.max_tokens, "temperature": 0}

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 20) == 0 or done == total:
            print(f"  {done}/{total} requests", file=sys.stderr, flush=True)

    with PDStack(model=args.model, connector=args.connector) as stack:
        send = load.RouterStreams(stack.router_url)
        print(f"warm-up: {args.concurrency * 4} requests", file=sys.stderr, flush=True)
        load.run(send, body, args.concurrency * 4, args.concurrency)
        servers = {"prefill": stack.prefill, "decode": stack.decode}
        before = {name: sum(server.memory().values()) for name, server in servers.items()}
        started = time.perf_counter()
        outcomes = load.run(send, body, args.requests, args.concurrency, progress=progress)
        wall = time.perf_counter() - started
        after = {name: sum(server.memory().values()) for name, server in servers.items()}
        alive = all(process.poll() is None for process in stack.processes().values())
    result = {"model": args.model, "connector": args.connector, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "wall_s": wall, "servers_alive": alive,
              **load.summary(outcomes, wall),
              **{f"{name}_rss_mib_before": before[name] / 2**20 for name in servers},
              **{f"{name}_rss_mib_after": after[name] / 2**20 for name in servers}}
    rows = [[k, v] for k, v in result.items()]
    text = table(["", "value"], rows)
    print(f"\nP/D soak through the router ({args.requests} streamed requests, concurrency {args.concurrency}):")
    print(text)
    if errors := load.first_errors(outcomes):
        print("first errors:", *errors, sep="\n  ")
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {OUT_DIR / 'soak.json'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="bench", required=True)
    reuse = commands.add_parser("reuse")
    reuse.add_argument("--model", default="smollm2")
    reuse.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 16000, 37000])
    reuse.add_argument("--repeats", type=int, default=5)
    kv = commands.add_parser("kv")
    kv.add_argument("--connectors", nargs="+", default=["shm", "nixl"])
    kv.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    kv.add_argument("--repeats", type=int, default=10)
    router = commands.add_parser("router")
    router.add_argument("--model", default="tiny")
    router.add_argument("--repeats", type=int, default=20)
    soak = commands.add_parser("soak")
    soak.add_argument("--model", default="tiny")
    soak.add_argument("--connector", choices=("shm", "nixl"), default="shm")
    soak.add_argument("--requests", type=int, default=2000)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    {"reuse": bench_reuse, "kv": bench_kv, "router": bench_router, "soak": bench_soak}[args.bench](args)


if __name__ == "__main__":
    main()
