"""P/D on vLLM's engine on one GPU: `python -m benchmarks gpu --model DIR`.

Starts a prefill server and a decode server with setting engine=vllm on the same GPU (each
engine takes `--gpu-memory-utilization` of it), the model in bfloat16 (`--dtype`), and pdchat's router,
then streams `--requests` chats of about `--prompt-tokens` prompt tokens and `--max-tokens`
answer tokens (EOS ignored) through the router at each `--concurrency`, after a warm-up.
Prints TTFT, inter-token latency and output tokens/s per concurrency and writes
bench-results/gpu.json and gpu.png. It needs a CUDA host with vLLM's CUDA wheel and pdchat in
the venv the servers run in (docs/engines.md, "On GPUs"); it is never part of CI.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import load
from benchmarks.report import plot, table, write_results

WARM_REQUESTS = 4
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def body(index: int, prompt_tokens: int, max_tokens: int) -> dict:
    """A chat of about `prompt_tokens` tokens, different per request so no prefix is shared."""
    words = [WORDS[(index * 7 + i) % len(WORDS)] for i in range(prompt_tokens)]
    return {
        "messages": [{"role": "user", "content": f"[{index}] " + " ".join(words)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def run(args: argparse.Namespace) -> None:
    from pdchat.launcher import PDStack

    engine_args = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        **json.loads(args.engine_args),
    }
    env = {"PDCHAT_ENGINE": "vllm", "PDCHAT_DTYPE": args.dtype, "PDCHAT_VLLM_ENGINE_ARGS": json.dumps(engine_args)}
    started = time.monotonic()
    print(f"starting the P/D pair on {args.model} (engine vllm; compiling CUDA graphs takes minutes)", flush=True)
    with PDStack(model=str(Path(args.model).expanduser()), env=env, log_dir=Path(args.log_dir)) as stack:
        print(f"ready in {time.monotonic() - started:.0f} s: router {stack.router_url}", flush=True)
        send = load.RouterStreams(stack.router_url, timeout=600)
        load.run(send, lambda i: body(i, args.prompt_tokens, args.max_tokens), WARM_REQUESTS, 1)
        results = {}
        for concurrency in args.concurrency:
            began = time.perf_counter()
            outcomes = load.run(
                send,
                lambda i, c=concurrency: body(1000 * c + i, args.prompt_tokens, args.max_tokens),
                args.requests,
                concurrency,
                progress=lambda done, total, c=concurrency: print(f"\r  c={c}: {done}/{total}", end="", flush=True),
            )
            print()
            results[concurrency] = load.summary(outcomes, time.perf_counter() - began)
            if results[concurrency]["errors"]:
                print("first errors:", load.first_errors(outcomes))
    rows = [
        [c, r["output_tokens_per_s"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"], r["errors"]]
        for c, r in results.items()
    ]
    print(table(["concurrency", "tok/s", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "errors"], rows))
    shape = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "requests": args.requests}
    write_results("gpu", {"model": args.model, "engine_args": engine_args, **shape, "by_concurrency": results})
    plot(
        "gpu",
        f"P/D on vLLM's engine, one GPU ({Path(args.model).name})",
        "concurrency",
        "output tokens/s",
        {"P/D through the router": (list(results), [r["output_tokens_per_s"] for r in results.values()])},
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a Hugging Face model directory on this host")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=64, help="per concurrency")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="each engine's share of the GPU")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (float32 to try it on a CPU host)")
    parser.add_argument("--engine-args", default="{}", help="more vLLM engine arguments, a JSON object")
    parser.add_argument("--log-dir", default="bench-results/gpu-logs")
