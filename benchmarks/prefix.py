"""`bench prefix`: what the prefix cache saves a multi-turn chat, turn by turn; with
`--servers 2`, how often routing finds it (clients/affinity.py, vllm-router).

One P/D pair (prefill server, decode server, router) per model and setting, started one
after the other in this run: prefix caching on, then off. The same 8-turn conversation
(a ~2k-token system prompt, short user turns, each answer appended to the next turn)
goes through the router, streamed; each turn's TTFT is read at its first chunk and its
`usage.prompt_tokens_details.cached_tokens` from the usage chunk. Each conversation is
run `--repeats` times with a fresh system prompt (a cold cache), medians reported.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.report import plot, table, write_results
from pdchat.core.settings import PREFIX_CACHING

SYSTEM_PARAGRAPH = (
    "You are the harbour master's assistant. You answer questions about tides, berths, pilots, cargo "
    "manifests and the weather, briefly and precisely, citing the harbour rules by number. "
)
QUESTIONS = [
    "When is high tide today?",
    "Which berth takes a 200 m tanker?",
    "Do I need a pilot to enter?",
    "What does rule 14 say about anchoring?",
    "Can I refuel at night?",
    "Who signs the cargo manifest?",
    "Is there a speed limit in the channel?",
    "Summarize what you told me.",
]


def one_turn(base_url: str, body: dict, *, with_prompt_tokens: bool = False) -> tuple:
    """(TTFT in seconds, the answer's content, the usage's cached_tokens[, its prompt_tokens])
    of one streamed chat."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(payload), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]!r}")
    ttft, text, cached, prompt = None, [], 0, 0
    for line in reply:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(str(chunk["error"]))
        if ttft is None:
            ttft = time.perf_counter() - started
        for choice in chunk.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
        if chunk.get("usage"):
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            prompt = chunk["usage"].get("prompt_tokens", 0)
    connection.close()
    return (ttft, "".join(text), cached, prompt) if with_prompt_tokens else (ttft, "".join(text), cached)


def conversation(base_url: str, system: str, max_tokens: int) -> list[dict]:
    """Each turn's TTFT (ms) and cached tokens, the answers carried into the next turn."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        ttft, answer, cached = one_turn(base_url, body)
        messages.append({"role": "assistant", "content": answer})
        turns.append({"ttft_ms": 1000 * ttft, "cached_tokens": cached})
    return turns


def system_prompt(tokenizer, tokens: int) -> str:
    """A fresh system prompt of about `tokens` tokens (its first words unique: a cold cache)."""
    repeat = max(1, tokens // len(tokenizer.encode(SYSTEM_PARAGRAPH)))
    return f"Session {uuid.uuid4()}. " + SYSTEM_PARAGRAPH * repeat


def run(args: argparse.Namespace) -> None:
    if args.servers > 1:
        return run_routing(args)
    from transformers import AutoTokenizer

    from pdchat import embedded
    from pdchat.launcher import PDStack

    results: dict[str, dict] = {}
    for model in args.models:
        tokenizer = AutoTokenizer.from_pretrained(embedded.ensure_model(model))
        for caching in ("on", "off"):
            env = {PREFIX_CACHING.env: "true" if caching == "on" else "false"}
            print(f"{model}, prefix caching {caching}: starting a P/D pair", file=sys.stderr, flush=True)
            with PDStack(model=model, env=env) as stack:
                one_turn(stack.router_url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
                runs = []
                for repeat in range(args.repeats):
                    print(f"  conversation {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
                    runs.append(conversation(stack.router_url, system_prompt(tokenizer, args.system_tokens), 16))
            results[f"{model}, cache {caching}"] = {
                "ttft_ms": [statistics.median(r[t]["ttft_ms"] for r in runs) for t in range(len(QUESTIONS))],
                "cached_tokens": [min(r[t]["cached_tokens"] for r in runs) for t in range(len(QUESTIONS))],
            }
    report(results, args)


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    turns = list(range(1, len(QUESTIONS) + 1))
    print(f"\nTTFT per turn (ms, median of {args.repeats}), ~{args.system_tokens}-token system prompt, one P/D pair:")
    headers = ["turn", *(f"cached: {name}" for name in results), *(f"TTFT: {name}" for name in results)]
    rows = [
        [t, *(r["cached_tokens"][t - 1] for r in results.values()), *(r["ttft_ms"][t - 1] for r in results.values())]
        for t in turns
    ]
    print(table(headers, rows))
    ratios = {}
    for model in args.models:
        on, off = results[f"{model}, cache on"]["ttft_ms"], results[f"{model}, cache off"]["ttft_ms"]
        ratios[model] = on[-1] / off[-1]
        print(f"{model}: turn {turns[-1]} TTFT with the cache / without = {ratios[model]:.2f}x (target <= 0.3x)")
    write_results(
        "prefix",
        {
            "system_tokens": args.system_tokens,
            "repeats": args.repeats,
            "turns": turns,
            "results": results,
            "last_turn_ratio": ratios,
        },
    )
    plot(
        "prefix",
        "TTFT per turn of an 8-turn chat, prefix cache on and off (one P/D pair)",
        "turn",
        "TTFT ms",
        {name: (turns, r["ttft_ms"]) for name, r in results.items()},
        logy=True,
    )


def routed_conversations(base_url: str, systems: list[str], turns: int, concurrency: int, model: str) -> list[dict]:
    """`len(systems)` conversations of `turns` turns, `concurrency` at once (each a worker's,
    its turns in order): per request its TTFT (ms), prompt and cached tokens."""
    import threading

    todo, lock, done = list(systems), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                system = todo.pop()
            messages = [{"role": "system", "content": system}]
            for question in QUESTIONS[:turns]:
                messages.append({"role": "user", "content": question})
                body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
                ttft, answer, cached, prompt = one_turn(base_url, body, with_prompt_tokens=True)
                messages.append({"role": "assistant", "content": answer})
                with lock:
                    done.append({"ttft_ms": 1000 * ttft, "cached_tokens": cached, "prompt_tokens": prompt})

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done


def run_routing(args: argparse.Namespace) -> None:
    """2 prefill servers and 1 decode; the same workload (fresh system prompts each time)
    through pdchat's router with --policy least-loaded, with --policy prefix, through
    vllm-router's cache_aware prefill policy over the servers' fronts, and through pdchat's
    router over one prefill server alone (the hit rate a single cache would get)."""
    import secrets

    from transformers import AutoTokenizer

    from benchmarks.load import percentile
    from benchmarks.scaleout import start_front, stop_all, vllm_router_command
    from pdchat import embedded
    from pdchat.core.settings import HANDOFF_KEY, MODEL
    from pdchat.launcher import TritonServer, free_port, start_service

    model = args.models[0]
    model_dir = embedded.ensure_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = {MODEL.env: model, HANDOFF_KEY.env: secrets.token_hex(32)}
    roles = ["prefill"] * args.servers + ["decode"]
    servers = [TritonServer(role=r, env=env, log_path=logs / f"{r}-{i}.log") for i, r in enumerate(roles)]
    processes = []
    results = {}
    try:
        print(f"starting {args.servers} prefill servers and 1 decode server", file=sys.stderr, flush=True)
        for server in servers:
            server.start()
        prefill, decode = [s.grpc_url for s in servers[:-1]], servers[-1].grpc_url

        def pdchat_router(policy: str, prefills: list[str]) -> str:
            port = free_port()
            command = [sys.executable, "-m", "pdchat.cli", "router", "--policy", policy, "--port", str(port)]
            command += [arg for url in prefills for arg in ("--prefill", url)] + ["--decode", decode]
            name = f"router-{policy}-{len(prefills)}"
            processes.append(start_service(command, f"http://127.0.0.1:{port}/health", logs / f"{name}.log"))
            return f"http://127.0.0.1:{port}"

        fronts = [start_front(s.grpc_url, logs / f"front-{i}.log") for i, s in enumerate(servers)]
        processes.extend(p for p, _ in fronts)
        urls = [u for _, u in fronts]
        port = free_port()
        command = vllm_router_command(urls[:-1], urls[-1:], port) + ["--prefill-policy", "cache_aware"]
        processes.append(start_service(command, f"http://127.0.0.1:{port}/health", logs / "vllm-router.log"))
        targets = {
            "least-loaded (pdchat router)": pdchat_router("least-loaded", prefill),
            "prefix (pdchat router)": pdchat_router("prefix", prefill),
            "cache_aware (vllm-router)": f"http://127.0.0.1:{port}",
            "one prefill server (reference)": pdchat_router("prefix", prefill[:1]),
        }
        for name, url in targets.items():
            print(f"  {name}", file=sys.stderr, flush=True)
            systems = [system_prompt(tokenizer, args.system_tokens) for _ in range(args.conversations)]
            done = routed_conversations(url, systems, args.turns, args.concurrency, model_dir.name)
            ttfts = sorted(d["ttft_ms"] for d in done)
            results[name] = {
                "requests": len(done),
                "hit_rate": sum(d["cached_tokens"] for d in done) / sum(d["prompt_tokens"] for d in done),
                "ttft_p50_ms": statistics.median(ttfts),
                "ttft_p99_ms": percentile(ttfts, 99),
            }
    finally:
        stop_all(processes, servers)
    single = results["one prefill server (reference)"]["hit_rate"]
    least = results["least-loaded (pdchat router)"]["ttft_p50_ms"]
    print(
        f"\n{args.conversations} conversations of {args.turns} turns at concurrency {args.concurrency}, "
        f"~{args.system_tokens}-token system prompts, {args.servers} prefill servers + 1 decode ({model}):"
    )
    columns = ["requests", "hit_rate", "ttft_p50_ms", "ttft_p99_ms"]
    rows = [
        [name, *(r[c] for c in columns), r["hit_rate"] / single, least / r["ttft_p50_ms"]]
        for name, r in results.items()
    ]
    print(table(["policy", *columns, "hit rate / one server", "TTFT p50 gain vs least-loaded"], rows))
    write_results(
        "prefix_routing",
        {
            "model": model,
            "servers": args.servers,
            "conversations": args.conversations,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "system_tokens": args.system_tokens,
            "results": results,
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], help="with --servers 2: the first")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1, help="prefill servers; 2: compare the routing policies")
    parser.add_argument("--conversations", type=int, default=16, help="with --servers 2")
    parser.add_argument("--turns", type=int, default=6, help="with --servers 2")
    parser.add_argument("--concurrency", type=int, default=4, help="with --servers 2")
    parser.add_argument("--log-dir", default="/tmp/pdchat-prefix-bench")
