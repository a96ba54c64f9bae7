"""Minimal repro: concurrent pb_utils Metric.increment() crashes tritonserver 2.51.

Starts tritonserver (pdchat.launcher.TritonServer) on repository/ (fan -> leaf, both
decoupled python models), sends `--requests` streamed requests to `fan` over
`--concurrency` gRPC streams, stops the server and prints one verdict line.

  .venv/bin/python scripts/metric_race_repro/repro.py --pattern old  --concurrency 16 --requests 300
  .venv/bin/python scripts/metric_race_repro/repro.py --pattern safe --concurrency 16 --requests 300

old: fan's 64 workers increment the same Metric objects at once (leaf: two threads);
safe: identical, except each Metric is incremented from one thread at a time;
fan-only / leaf-only: only that model keeps the racing increments.
"""

import argparse
import queue
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from pdchat.core.settings import cache_dir
from pdchat.launcher import TritonServer

HERE = Path(__file__).resolve().parent
# Pattern -> (fan's, leaf's) pattern; the models read BLS_REPRO_FAN / BLS_REPRO_LEAF.
PATTERNS = {"old": ("old", "old"), "safe": ("safe", "safe"), "fan-only": ("old", "safe"), "leaf-only": ("safe", "old")}


def drive(url, concurrency, requests, tokens, deadline_s):
    """Send `requests` streamed requests over `concurrency` streams; (done, errors, first error)."""
    counter = iter(range(requests))
    lock = threading.Lock()
    done, errors = [0], []

    def stream_worker():
        client = grpcclient.InferenceServerClient(url)
        answers = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=deadline_s)
        try:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                n = grpcclient.InferInput("n", [1], "INT32")
                n.set_data_from_numpy(np.array([tokens], dtype=np.int32))
                client.async_stream_infer("fan", [n], request_id=str(i), enable_empty_final_response=True)
                while True:
                    try:
                        result, error = answers.get(timeout=10)
                    except queue.Empty:
                        error = "no response for 10 s"
                    if error is not None:
                        with lock:
                            errors.append(str(error))
                        return  # a dead server: this stream is done
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        with lock:
                            done[0] += 1
                        break
        finally:
            client.stop_stream(cancel_requests=False)
            client.close()

    threads = [threading.Thread(target=stream_worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s)
    return done[0], errors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", choices=tuple(PATTERNS), default="old")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=16, help="responses per request")
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args()

    log = args.log or cache_dir() / "logs" / f"metric_race_{args.pattern}_{int(time.time())}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    fan, leaf = PATTERNS[args.pattern]
    server = TritonServer(
        model_repository=HERE / "repository",
        env={"BLS_REPRO_FAN": fan, "BLS_REPRO_LEAF": leaf},
        log_path=log,
        extra_args=("--exit-timeout-secs=5",),
    )
    server.start(timeout=120)
    started = time.perf_counter()
    try:
        done, errors = drive(server.grpc_url, args.concurrency, args.requests, args.tokens, deadline_s=300)
        wall = time.perf_counter() - started
        time.sleep(0.5)
        exit_code = server.process.poll()
        text = log.read_text(errors="replace")  # before stop(): its SIGTERM is logged as "Signal (15)"
    finally:
        server.stop(timeout=15)
    signal = re.search(r"Signal \((\d+)\) received", text)
    crashed = exit_code is not None or signal is not None
    first = f" first_error={errors[0][:120]!r}" if errors else ""
    print(
        f"pattern={args.pattern} concurrency={args.concurrency} requests={args.requests} "
        f"crashed={'yes' if crashed else 'no'} "
        f"signal={signal.group(1) if signal else '-'} exit={exit_code} completed={done} errors={len(errors)} "
        f"wall={wall:.1f}s log={log}{first}"
    )
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
