"""A supervised P/D stack under mixed load and faults: `python -m benchmarks chaos`.

Streams N requests at concurrency C through the router of a `pdchat pd`-like stack (prefill,
decode, router, kept running by `pdchat.supervisor`): plain chats, tool calls (auto and
forced), JSON-schema output, logprobs, clients that leave mid-stream and bad requests. Along
the way it `kill -9`s decode's python stub (at 15% of the requests; the supervisor restarts
that server), SIGSTOPs the decode tritonserver for `--stop-s` seconds (at 35%) and `kill -9`s
the prefill tritonserver (at 55%; decode serves alone meanwhile), each once the server the
fault before it hit is back. A client whose request failed waits `RETRY_AFTER_S` before its
next, as a client that honours 503s does (else an outage burns the run's requests in
seconds). It reports:

- errors by kind, split into those of requests in flight at a fault (or refused while a
  server was down: 503 at once) and the rest, which should be none; the former by error
  (status and code) with their longest time to fail;
- every process's RSS after warm-up and at the end;
- KV files left in the shm KV directory once idle: those of dead engines (a sweep frees them
  within a second: there should be none), those of live ones (published KV waiting for a
  pull, pages handed back for reuse: each goes at its expiry), and what is left once the
  last of those expiries has passed; python-backend shm after the stop;

and writes bench-results/chaos.json and chaos.png (outcomes per second, faults marked).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from benchmarks import load
from benchmarks.report import OUT_DIR, table, write_results

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# One kind per request, in turn: what each asks, and what its client does.
KINDS = ("plain", "plain", "plain", "tools", "forced_tool", "json_schema", "logprobs", "leaves", "bad", "plain")
LEAVE_AFTER = 3  # chunks a leaving client reads
RETRY_AFTER_S = 1.0  # a client's wait after a failed request


@dataclass(frozen=True)
class Sent:
    kind: str
    started: float
    ended: float
    outcome: load.Outcome

    @property
    def failed(self) -> bool:
        """Not what this kind expects: a bad request must be refused 400, the rest answered."""
        if self.kind == "bad":
            return not self.outcome.error.startswith("HTTP 400")
        return not self.outcome.ok


def body(index: int, max_tokens: int) -> tuple[str, dict]:
    kind = KINDS[index % len(KINDS)]
    request: dict = {
        "messages": [{"role": "user", "content": f"Request {index}: plan a trip " + "and more " * (index % 5)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if kind == "tools":
        request["tools"] = [WEATHER]
    elif kind == "forced_tool":
        request |= {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 40}
    elif kind == "json_schema":
        request |= {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}
        request["max_tokens"] = 40
    elif kind == "logprobs":
        request |= {"logprobs": True, "top_logprobs": 2}
    elif kind == "bad":
        request["messages"] = [{"role": "wizard", "content": "hi"}]
    return kind, request


class Faults(threading.Thread):
    """kill -9 of decode's stub at 15% of the requests, SIGSTOP of decode for `stop_s` at 35%,
    kill -9 of prefill at 55%; each waits for the server to be back from the one before."""

    def __init__(self, stack, requests: int, stop_s: float, done: list):
        super().__init__(daemon=True)
        self.stack, self.requests, self.stop_s, self.done = stack, requests, stop_s, done
        self.windows: list[tuple[str, float, float]] = []  # (fault, from, until)

    def run(self) -> None:
        from pdchat.launcher import python_stubs

        self._wait_for(0.15)
        server = self.stack.decode.process.pid
        [stub] = [pid for pid, (model, _) in python_stubs(server).items() if model == "decode"]
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        say("fault: kill -9 of decode's python stub")
        self._wait_ready(self.stack.decode, replacing=server)
        self.windows.append(("decode stub kill -9", killed_at, time.monotonic()))
        self._wait_for(0.35)
        decode = self.stack.decode.process.pid
        stopped_at = time.monotonic()
        os.kill(decode, signal.SIGSTOP)
        say(f"fault: SIGSTOP of the decode tritonserver for {self.stop_s:g} s")
        time.sleep(self.stop_s)
        os.kill(decode, signal.SIGCONT)
        self._wait_ready(self.stack.decode)
        self.windows.append(("decode SIGSTOP", stopped_at, time.monotonic()))
        self._wait_for(0.55)
        killed_at = time.monotonic()
        os.kill(self.stack.prefill.process.pid, signal.SIGKILL)
        say("fault: kill -9 of the prefill tritonserver")
        self._wait_ready(self.stack.prefill)
        self.windows.append(("prefill kill -9", killed_at, time.monotonic()))

    def _wait_for(self, share: float) -> None:
        while len(self.done) < share * self.requests:
            time.sleep(0.2)

    @staticmethod
    def _wait_ready(server, replacing: int | None = None) -> None:
        """Until `server` is ready (and, with `replacing`, runs another process than that pid)."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if server.process.pid != replacing and server.is_ready():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.5)

    def at_fault(self, sent: Sent, grace_s: float) -> bool:
        """In flight at a fault, or sent while a server was down (until `grace_s` after it was back)."""
        return any(sent.started <= until + grace_s and sent.ended >= start for _, start, until in self.windows)


def run(args: argparse.Namespace) -> None:
    from pdchat import embedded
    from pdchat.core.kv.shm import kv_directory, left_by_dead_engines, live_engines
    from pdchat.launcher import PDStack, resident_bytes
    from pdchat.supervisor import Supervisor

    embedded.ensure_model(args.model)
    os.environ.setdefault("PDCHAT_STALL_TIMEOUT_S", str(args.stall_s))
    sent: list[Sent] = []
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 20) == 0 or done == total:
            say(f"{done}/{total} requests")

    with PDStack(model=args.model, connector=args.connector) as stack:
        stop = threading.Event()
        supervisor = Supervisor(stack.children(), say=say)
        watcher = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
        watcher.start()
        streams = load.RouterStreams(stack.router_url, timeout=args.stall_s + 30)

        def send(index: int) -> load.Outcome:
            kind, request = body(index, args.max_tokens)
            started = time.monotonic()
            outcome = streams(request, LEAVE_AFTER if kind == "leaves" else None)
            record = Sent(kind, started, time.monotonic(), outcome)
            with lock:
                sent.append(record)
            if record.failed:
                time.sleep(RETRY_AFTER_S)
            return outcome

        say(f"warm-up: {args.concurrency * 4} requests")
        load.run(lambda index, _: send(index), lambda i: i, args.concurrency * 4, args.concurrency)
        sent.clear()

        def memory() -> dict[str, int]:
            return {
                "prefill": sum(stack.prefill.memory().values()),
                "decode": sum(stack.decode.memory().values()),
                "router": sum(resident_bytes([stack.router.pid]).values()),
            }

        before = memory()
        faults = Faults(stack, args.requests, args.stop_s, sent)
        faults.start()
        began = time.monotonic()
        load.run(lambda index, _: send(index), lambda i: i, args.requests, args.concurrency, progress=progress)
        wall = time.monotonic() - began
        faults.join(timeout=600)
        time.sleep(args.idle_s)  # expiries and sweeps
        after = memory()
        kv = kv_check(kv_directory(), live_engines, left_by_dead_engines)
        stop.set()
        watcher.join(10)
        restarts = supervisor.restarts()
        servers = (stack.prefill, stack.decode)
    shm_left = [str(path) for server in servers for path in server.leaked_shm()]
    report(args, sent, faults, wall, before, after, kv, shm_left, restarts)


def kv_check(directory, live_engines, left_by_dead_engines) -> dict[str, list[str]]:
    """The KV directory once idle: files and owner locks of dead engines (none expected),
    files of live ones, and what is left once the latest expiry among those has passed."""

    def listing() -> list[str]:
        return sorted(p.name for p in directory.glob("*pdchat_kv*")) if directory.exists() else []

    names = listing()
    live = live_engines(directory) if directory.exists() else set()
    files = [n for n in names if "_kvowner_" not in n]
    dead_files = left_by_dead_engines(files, live)
    # A dead engine's lock stays while KV it published waits for a pull (until its expiry).
    published_by = {n.split("_")[2] for n in files if n.startswith("pdchat_kv_")}
    dead_locks = [n for n in names if "_kvowner_" in n and n.rsplit("_", 1)[1] not in live | published_by]
    expiries = [int(n.split("_")[3]) / 1000 for n in files if n.split("_")[3].isdigit()]
    if expiries:  # each goes at the sweep after its expiry
        time.sleep(max(0.0, min(max(expiries) - time.time(), 120.0)) + 2 * 1.0 + 1)
    return {
        "kv_files_of_dead_engines": dead_files + dead_locks,
        "kv_files_of_live_engines": [n for n in files if n not in dead_files],
        "kv_files_left_after_their_expiry": [n for n in listing() if "_kvowner_" not in n],
    }


def report(args, sent, faults, wall, before, after, kv, shm_left, restarts) -> None:
    grace_s = args.stall_s + 5
    failed = [s for s in sent if s.failed]
    at_fault = [s for s in failed if faults.at_fault(s, grace_s)]
    unexpected = [s for s in failed if not faults.at_fault(s, grace_s)]
    by_kind = Counter(s.kind for s in sent)
    result = {
        "model": args.model,
        "requests": len(sent),
        "concurrency": args.concurrency,
        "wall_s": wall,
        "faults": [
            {"fault": name, "from_s": start - sent[0].started, "until_s": until - sent[0].started}
            for name, start, until in faults.windows
        ]
        if sent
        else [],
        "failed_at_faults": len(at_fault),
        "failed_at_faults_by_error": dict(Counter(_error_class(s.outcome.error) for s in at_fault).most_common()),
        "failed_at_faults_longest_s": max((s.ended - s.started for s in at_fault), default=0.0),
        "failed_by_fault": {
            name: sum(1 for s in at_fault if s.started <= until + grace_s and s.ended >= start)
            for name, start, until in faults.windows
        },
        "failed_elsewhere": len(unexpected),
        "failed_elsewhere_first": sorted({f"{s.kind}: {s.outcome.error[:160]}" for s in unexpected})[:10],
        "by_kind": dict(by_kind),
        "failed_by_kind": dict(Counter(s.kind for s in failed)),
        "restarts": restarts,
        "rss_mib_after_warm_up": {k: v / 2**20 for k, v in before.items()},
        "rss_mib_at_end": {k: v / 2**20 for k, v in after.items()},
        "rss_growth": {k: after[k] / before[k] - 1 for k in before if before[k]},
        **kv,
        "python_backend_shm_left": shm_left,
    }
    rows = [[k, v] for k, v in result.items() if not isinstance(v, list | dict)]
    rows += [[f"rss growth {k}", f"{v:+.1%}"] for k, v in result["rss_growth"].items()]
    print(f"\nchaos through the P/D router ({len(sent)} streamed requests, concurrency {args.concurrency}):")
    print(table(["", "value"], rows))
    for line in result["failed_elsewhere_first"]:
        print("  unexpected:", line)
    write_results("chaos", result)
    plot_timeline(sent, faults)


def _error_class(error: str) -> str:
    """An error's status (`HTTP 503`, or `in stream` for an error event) and its OpenAI code,
    e.g. `HTTP 503 unavailable`; other failures by their first words."""
    code = re.search(r"""['"]code['"]: ['"]([^'"]+)['"]""", error)
    if error.startswith("HTTP "):
        return f"{error[:8]} {code[1] if code else ''}".strip()
    if code:
        return f"in stream {code[1]}"
    return " ".join(error.split()[:4])[:60]


def plot_timeline(sent: list[Sent], faults: Faults) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    if not sent:
        return
    origin = min(s.started for s in sent)
    seconds = int(max(s.ended for s in sent) - origin) + 1
    answered, failed = [0] * seconds, [0] * seconds
    for s in sent:
        (failed if s.failed else answered)[int(s.ended - origin)] += 1
    figure, axis = plt.subplots(figsize=(8, 4.2))
    axis.plot(range(seconds), answered, label="as expected")
    axis.plot(range(seconds), failed, label="failed", color="tab:red")
    for name, start, until in faults.windows:
        axis.axvspan(start - origin, until - origin, alpha=0.15, color="tab:orange")
        axis.text(start - origin, max(answered) * 0.95, name, fontsize=8)
    axis.set(title="requests ending per second, faults shaded", xlabel="s", ylabel="requests")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    OUT_DIR.mkdir(exist_ok=True)
    figure.savefig(OUT_DIR / "chaos.png", dpi=120)
    print(f"plot: {OUT_DIR / 'chaos.png'}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--connector", default="shm")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--stop-s", type=float, default=45.0, help="how long decode stays SIGSTOPped")
    parser.add_argument("--stall-s", type=float, default=10.0, help="the router's stall deadline for this run")
    parser.add_argument("--idle-s", type=float, default=8.0, help="idle time before the final checks")


def say(message: str) -> None:
    print(f"[chaos] {message}", file=sys.stderr, flush=True)
