"""`bench prefix`: what the prefix cache saves a multi-turn chat, turn by turn.

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
from urllib.parse import urlsplit

from pdchat.clients.report import plot, table, write_results
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


def one_turn(base_url: str, body: dict) -> tuple[float, str, int]:
    """(TTFT in seconds, the answer's content, the usage's cached_tokens) of one streamed chat."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(payload), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]!r}")
    ttft, text, cached = None, [], 0
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
            cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    connection.close()
    return ttft, "".join(text), cached


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
