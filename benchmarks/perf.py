"""Drive `chat` with perf_analyzer (the one in tritonclient 2.50's wheel) and report TTFT.

perf_analyzer prints whole-stream latency for decoupled models; the first-response
latency (time to first token) and the gaps between responses are only in its profile
export, so this reads that file and prints them per concurrency.

    python -m benchmarks.perf --url 127.0.0.1:8001 --prompt-words 2000 --concurrency 1 2 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.load import Outcome, summary
from benchmarks.report import table


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
    body = {
        "messages": [{"role": "user", "content": f"Summarize: {words}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    return {"data": [{"request": [json.dumps(body)]}]}


def summarize(export: dict) -> dict[int, dict[str, float]]:
    """Per concurrency: the stream statistics of benchmarks.load.summary, computed from
    each request's send and response timestamps (ns) in perf_analyzer's profile export."""
    results = {}
    for experiment in export["experiments"]:
        requests = [r for r in experiment["requests"] if r.get("response_timestamps")]
        outcomes = [
            Outcome(
                True,
                "",
                (r["response_timestamps"][-1] - r["timestamp"]) / 1e9,
                tuple((t - r["timestamp"]) / 1e9 for t in r["response_timestamps"]),
            )
            for r in requests
        ]
        window = (
            (max(r["response_timestamps"][-1] for r in requests) - min(r["timestamp"] for r in requests)) / 1e9
            if requests
            else 0
        )
        results[experiment["experiment"]["value"]] = summary(outcomes, window)
    return results


def perf_analyzer_binary() -> str:
    """perf_analyzer of the tritonclient wheel: beside this interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    return str(beside) if beside.exists() else "perf_analyzer"


def profile(url: str, model: str, concurrency: list[int], prompt_words: int, max_tokens: int) -> dict:
    """Run perf_analyzer over gRPC streaming at each concurrency (one run each: a range
    would visit every value between); the experiments of their profile exports."""
    experiments = []
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "input.json"
        data.write_text(json.dumps(input_data(prompt_words, max_tokens)))
        for value in concurrency:
            export = Path(scratch) / f"profile-{value}.json"
            # Windows of 2x concurrency requests, stability not asked for: the statistics come
            # from the export's timestamps, and a noisy 2-core host would otherwise end the run
            # without writing the export.
            command = [
                perf_analyzer_binary(),
                "-m",
                model,
                "-u",
                url,
                "-i",
                "grpc",
                "--streaming",
                "--input-data",
                str(data),
                "--concurrency-range",
                f"{value}:{value}",
                "--measurement-mode",
                "count_windows",
                "--measurement-request-count",
                str(max(8, 2 * value)),
                "--stability-percentage",
                "1000",
                "--max-trials",
                "3",
                "--profile-export-file",
                str(export),
            ]
            print(" ".join(command), file=sys.stderr, flush=True)
            completed = subprocess.run(command, env=perf_analyzer_env(), text=True, capture_output=True)
            if completed.returncode != 0 or not export.exists():
                raise RuntimeError(
                    f"perf_analyzer failed ({completed.returncode}):\n"
                    f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
                )
            experiments += json.loads(export.read_text())["experiments"]
    return {"experiments": experiments}


COLUMNS = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "latency_p50_ms")


def rows(results: dict[int, dict[str, float]], wanted: list[int]) -> list[list[object]]:
    return [[c, int(results[c]["requests"]), *(results[c][k] for k in COLUMNS)] for c in wanted if c in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC address")
    parser.add_argument("--model", default="chat")
    parser.add_argument("--prompt-words", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    try:
        export = profile(args.url, args.model, args.concurrency, args.prompt_words, args.max_tokens)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"\nperf_analyzer on {args.model}, ~{args.prompt_words}-word prompt, {args.max_tokens} tokens:")
    print(table(["concurrency", "requests", *COLUMNS], rows(summarize(export), args.concurrency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
