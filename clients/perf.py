"""Drive `chat` with perf_analyzer (the one in tritonclient 2.50's wheel) and report TTFT.

perf_analyzer prints whole-stream latency for decoupled models; the first-response
latency (time to first token) and the gaps between responses are only in its profile
export, so this reads that file and prints them per concurrency.

    python -m pdchat.clients.perf --url 127.0.0.1:8001 --prompt-words 2000 --concurrency 1 2 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pdchat.clients.bench import table


def perf_analyzer_env() -> dict[str, str]:
    """perf_analyzer loads libcudart.so.12 even on CPU: point it at the PyPI runtime."""
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec and spec.submodule_search_locations:
        lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH")) if p)
    return env


def input_data(prompt_words: int, max_tokens: int) -> dict:
    """One streamed chat request of about `prompt_words` words, for --input-data."""
    words = " ".join(f"w{i % 113}" for i in range(prompt_words))
    body = {"messages": [{"role": "user", "content": f"Summarize: {words}"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    return {"data": [{"request": [json.dumps(body)]}]}


def summarize(export: dict) -> list[list[object]]:
    rows = []
    for experiment in export["experiments"]:
        requests = [r for r in experiment["requests"] if r.get("response_timestamps")]
        ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in requests]
        gaps = [(b - a) / 1e6 for r in requests for a, b in zip(r["response_timestamps"], r["response_timestamps"][1:], strict=False)]
        whole = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in requests]
        rows.append([experiment["experiment"]["value"], len(requests), statistics.median(ttft),
                     statistics.median(gaps) if gaps else 0.0, statistics.median(whole)])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC address")
    parser.add_argument("--model", default="chat")
    parser.add_argument("--prompt-words", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--measurement-ms", type=int, default=8000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        data, export = Path(scratch) / "input.json", Path(scratch) / "profile.json"
        data.write_text(json.dumps(input_data(args.prompt_words, args.max_tokens)))
        command = ["perf_analyzer", "-m", args.model, "-u", args.url, "-i", "grpc", "--streaming",
                   "--input-data", str(data), "--concurrency-range", f"{min(args.concurrency)}:{max(args.concurrency)}",
                   "--measurement-interval", str(args.measurement_ms), "--stability-percentage", "50",
                   "--profile-export-file", str(export)]
        print(" ".join(command), file=sys.stderr)
        completed = subprocess.run(command, env=perf_analyzer_env(), text=True, capture_output=True)
        if completed.returncode != 0 or not export.exists():
            print(completed.stdout[-3000:], completed.stderr[-3000:], sep="\n", file=sys.stderr)
            return completed.returncode or 1
        rows = [r for r in summarize(json.loads(export.read_text())) if r[0] in args.concurrency]
    print(f"\nperf_analyzer on {args.model}, ~{args.prompt_words}-word prompt, {args.max_tokens} tokens (medians, ms):")
    print(table(["concurrency", "requests", "time to first token", "inter-token gap", "whole stream"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
