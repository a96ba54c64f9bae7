"""End to end: how much sooner the first token comes when decode reuses prefill's ids.

On a P/D pair (shm connector), each request runs the two legs the router runs, in one of
two modes:

- `reuse` (pdchat): decode gets the ids (binary tensor) and the signed handoff, and
  skips the renderer;
- `baseline` (vLLM before forwarded ids): decode gets the signed handoff without the
  ids, renders and tokenizes the conversation itself, and uses the transferred KV only
  once its ids hash to the signed digest.

Per prompt length, mode and concurrency it reports the end-to-end time to first token
(p50/p90), the decode leg's time to first token, the inter-token gap, and the time each
model spent per request from Triton's statistics; and, beside it, what parsing, rendering
and tokenizing that conversation costs in-process, which the decode legs should differ by.

    python -m benchmarks e2e [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from benchmarks.report import plot, table, timed, write_results
from pdchat.clients.chat import GrpcChat, chat_inputs
from pdchat.launcher import each_in_a_thread

MODES = ("reuse", "baseline")
STAT_MODELS = ("chat", "renderer", "prefill", "decode")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def conversation(tokenizer, tokens: int, index: int) -> dict:
    """A multi-turn chat with a system prompt and a tool, about `tokens` long; `index`
    varies its first words so no two requests are the same."""
    paragraph = "The committee reviewed the quarterly figures, cafés and budgets, and agreed to meet again. "
    repeat = max(1, tokens // len(tokenizer.encode(paragraph)) // 4)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": paragraph * repeat} for i in range(3)]
    turns.append({"role": "user", "content": f"Question {index}: " + paragraph * repeat})
    return {
        "messages": [{"role": "system", "content": "You are a careful analyst."}, *turns],
        "tools": [TOOL],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def one_request(prefill: GrpcChat, decode: GrpcChat, body: dict, mode: str) -> dict[str, float]:
    """Both legs, as the router runs them; times in seconds from the start."""
    started = time.perf_counter()
    [handed] = list(prefill.stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
    prefilled = time.perf_counter()
    forwarded = {"kv_transfer_params": handed.kv_transfer_params_json}
    if mode == "reuse":
        forwarded["prompt_token_ids"] = handed.prompt_token_ids
    arrivals = [time.perf_counter() for _ in decode.stream(chat_inputs(body, **forwarded))]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "ttft": arrivals[0] - started,
        "decode_ttft": arrivals[0] - prefilled,
        "itl": statistics.median(gaps) if gaps else 0.0,
        "tokens": len(handed.prompt_token_ids),
    }


def server_time(url: str) -> dict[str, tuple[float, int]]:
    """(compute seconds, executions) per model so far, from Triton's statistics."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = {}
        for model in STAT_MODELS:
            entry = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
            stats[model] = (
                int(entry["inference_stats"].get("compute_infer", {}).get("ns", 0)) / 1e9,
                int(entry.get("execution_count", 0)),
            )
        return stats
    finally:
        client.close()


def run_cell(stack, tokenizer, tokens: int, mode: str, concurrency: int, requests: int) -> dict:
    """`requests` requests at `concurrency` of one length and mode; per-request numbers."""
    before = {
        role: server_time(server.grpc_url) for role, server in (("prefill", stack.prefill), ("decode", stack.decode))
    }
    results: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        prefill, decode = GrpcChat(stack.prefill.grpc_url), GrpcChat(stack.decode.grpc_url)
        try:
            for index in counter:
                result = one_request(prefill, decode, conversation(tokenizer, tokens, index), mode)
                with lock:
                    results.append(result)
        finally:
            prefill.close()
            decode.close()

    errors = each_in_a_thread([worker] * concurrency)
    if errors:
        raise errors[0]
    after = {
        role: server_time(server.grpc_url) for role, server in (("prefill", stack.prefill), ("decode", stack.decode))
    }
    split = {
        f"{role} {model} ms": 1000 * (after[role][model][0] - before[role][model][0]) / len(results)
        for role in after
        for model in STAT_MODELS
        if after[role][model][1] > before[role][model][1]
    }
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "prompt_tokens": round(statistics.median(r["tokens"] for r in results)),
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(results),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "decode_ttft_p50_ms": 1000 * statistics.median(r["decode_ttft"] for r in results),
        "itl_p50_ms": 1000 * statistics.median(r["itl"] for r in results),
        **split,
    }


def bls_overhead(stack, model_dir, tokenizer, tokens: int, repeats: int) -> dict[str, float]:
    """The decode leg's time to first token through `chat` (reuse path: parse, gate, BLS)
    against calling `decode` itself with the same ids, KV handle and seal; a fresh prefill
    before each, interleaved."""
    from pdchat.clients.chat import GrpcChat
    from pdchat.core.kv.base import KVHandle
    from pdchat.core.request.protocol import chat_request_from_body
    from pdchat.core.request.rendering import ChatRenderer
    from pdchat.ensemble.seal import StageSeal

    renderer = ChatRenderer(model_dir, model_dir.name)  # its context length and vocabulary, as decode's chat has them
    seal = StageSeal.of_server(stack.decode.process.pid)  # decode's own key: a seal opens its server only
    prefill, decode, direct = (
        GrpcChat(stack.prefill.grpc_url),
        GrpcChat(stack.decode.grpc_url),
        GrpcChat(stack.decode.grpc_url, "decode"),
    )
    samples: dict[str, list[float]] = {"through chat": [], "decode directly": []}
    try:
        for index in range(repeats):
            for path, values in samples.items():
                body = {**conversation(tokenizer, tokens, index), "stream": True}
                [handed] = list(prefill.stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
                ids = handed.prompt_token_ids
                if path == "through chat":
                    inputs = chat_inputs(body, prompt_token_ids=ids, kv_transfer_params=handed.kv_transfer_params_json)
                    client = decode
                else:
                    params = renderer.render(
                        chat_request_from_body(body)
                    ).params.to_json()  # untimed, as chat's gate path makes them
                    handle = KVHandle.from_dict(handed.kv_transfer_params["kv_handle"]).to_json()
                    inputs = _stage_inputs(ids, params, handle, seal.seal_prompt(ids, params, handle))
                    client = direct
                started = time.perf_counter()
                stream = client.stream(inputs)
                next(stream)
                values.append(time.perf_counter() - started)
                for _ in stream:  # the rest of the answer
                    pass
    finally:
        for client in (prefill, decode, direct):
            client.close()
    return {path: 1000 * statistics.median(values) for path, values in samples.items()}


def _stage_inputs(ids: list[int], params: str, handle: str, seal: str) -> dict:
    import numpy as np

    from pdchat import tensors

    def text(value: str):
        return np.array([value.encode()], dtype=np.object_)

    return {
        tensors.PROMPT_TOKEN_IDS: np.asarray(ids, dtype=np.int32),
        tensors.GENERATION_PARAMS: text(params),
        tensors.KV_HANDLE: text(handle),
        tensors.STAGE_SEAL: text(seal),
    }


def render_cost(model_dir, tokenizer, tokens: int, repeats: int) -> float:
    """Parse + render + tokenize of one such conversation in-process, median ms."""
    import json

    from pdchat.core.request.protocol import parse_chat_json
    from pdchat.core.request.rendering import ChatRenderer

    renderer = ChatRenderer(model_dir, model_dir.name)
    body = json.dumps(conversation(tokenizer, tokens, 0))
    return 1000 * statistics.median(timed(lambda: renderer.token_ids(parse_chat_json(body)), repeats))


def bench_e2e(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from pdchat import embedded
    from pdchat.launcher import PDStack

    model_dir = embedded.ensure_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = args.tokens or ([1000, 4000] if args.quick else [1000, 4000, 15000])
    requests = args.requests or (4 if args.quick else 12)
    cells = [(n, mode, c) for n in lengths for c in args.concurrency for mode in MODES]
    rows, by_cell = [], {}
    print(
        f"starting a P/D pair on {args.model} (shm); {len(cells)} cells of {requests} requests",
        file=sys.stderr,
        flush=True,
    )
    with PDStack(model=args.model, connector="shm") as stack:
        for mode in MODES:  # warm-up: both paths, once each
            run_cell(stack, tokenizer, lengths[0], mode, 1, 2)
        for done, (tokens, mode, concurrency) in enumerate(cells, 1):
            row = run_cell(stack, tokenizer, tokens, mode, concurrency, requests)
            rows.append(row)
            by_cell[(tokens, mode, concurrency)] = row
            print(
                f"  [{done}/{len(cells)}] {row['prompt_tokens']} tokens, {mode}, concurrency {concurrency}: "
                f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, decode leg {row['decode_ttft_p50_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        print("BLS overhead: the decode leg through chat vs decode called directly", file=sys.stderr, flush=True)
        bls = [[tokens, *bls_overhead(stack, model_dir, tokenizer, tokens, requests).values()] for tokens in lengths]
    renders = {tokens: render_cost(model_dir, tokenizer, tokens, 5) for tokens in lengths}
    columns = ["prompt_tokens", "mode", "concurrency", "ttft_p50_ms", "ttft_p90_ms", "decode_ttft_p50_ms", "itl_p50_ms"]
    print(f"\nEnd to end on a P/D pair ({args.model}, shm; {requests} requests per cell, 16 output tokens):")
    print(table(columns, [[row[c] for c in columns] for row in rows]))
    savings = []
    for tokens in lengths:
        for concurrency in args.concurrency:
            reuse, baseline = (by_cell[(tokens, mode, concurrency)] for mode in MODES)
            saved = baseline["decode_ttft_p50_ms"] - reuse["decode_ttft_p50_ms"]
            savings.append([reuse["prompt_tokens"], concurrency, saved, renders[tokens], saved / renders[tokens]])
    print("\nDecode leg, baseline minus reuse, against parse + render + tokenize in-process:")
    print(table(["prompt tokens", "concurrency", "saved ms", "render ms", "saved / render"], savings))
    print("\nDecode leg's time to first token on the reuse path, through chat vs decode called directly (p50 ms):")
    print(table(["prompt tokens (target)", "through chat", "decode directly"], bls))
    split_columns = sorted({k for r in rows for k in r if k.endswith(" ms") and k not in columns})
    print("\nServer time per request (Triton compute_infer), ms:")
    print(
        table(
            ["prompt tokens", "mode", "concurrency", *split_columns],
            [[r["prompt_tokens"], r["mode"], r["concurrency"], *[r.get(k, 0.0) for k in split_columns]] for r in rows],
        )
    )
    write_results(
        "e2e",
        {
            "model": args.model,
            "connector": "shm",
            "requests_per_cell": requests,
            "rows": rows,
            "render_ms": {str(k): v for k, v in renders.items()},
            "bls_overhead_ms": [{"tokens": r[0], "through_chat": r[1], "decode_directly": r[2]} for r in bls],
            "saved_vs_render": [
                dict(zip(["prompt_tokens", "concurrency", "saved_ms", "render_ms", "ratio"], s, strict=True))
                for s in savings
            ],
        },
    )
    plot_e2e(rows)


def plot_e2e(rows: list[dict]) -> None:
    """Per concurrency: TTFT end to end, and the decode leg's (where the reuse shows), by prompt length."""
    for concurrency in sorted({r["concurrency"] for r in rows}):
        cell = [r for r in rows if r["concurrency"] == concurrency]
        series = {}
        for mode in MODES:
            mine = [r for r in cell if r["mode"] == mode]
            series[f"{mode}: end to end"] = ([r["prompt_tokens"] for r in mine], [r["ttft_p50_ms"] for r in mine])
            series[f"{mode}: decode leg"] = (
                [r["prompt_tokens"] for r in mine],
                [r["decode_ttft_p50_ms"] for r in mine],
            )
        plot(
            f"e2e_ttft_c{concurrency}",
            f"Time to first token through a P/D pair (concurrency {concurrency})",
            "prompt tokens",
            "TTFT p50 (ms, log)",
            series,
            logx=True,
            logy=True,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--quick", action="store_true", help="two lengths, 4 requests per cell (a few minutes)")
    parser.add_argument(
        "--tokens", type=int, nargs="+", help="prompt lengths (default 1k, 4k, 15k: the tiny model's context is 16k)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, help="requests per cell")
