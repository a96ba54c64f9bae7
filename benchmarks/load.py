"""Bounded concurrent load: N requests at concurrency C, some abandoned mid-stream.

Used by the soak tests and `python -m benchmarks soak`. Each worker thread
keeps its own connection; a request's outcome is recorded, never raised, so one
failure does not hide the others.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdchat.clients.chat import ChatError, GrpcChat, chat_inputs


@dataclass(frozen=True)
class Outcome:
    """One request: whether it ended as expected, its timings and what it received.
    `arrivals`: seconds from sending the request to each streamed chunk."""

    ok: bool
    error: str = ""
    latency_s: float = 0.0
    arrivals: tuple[float, ...] = ()
    abandoned: bool = False

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] if self.arrivals else 0.0

    @property
    def chunks(self) -> int:
        return len(self.arrivals)

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


class RouterStreams:
    """Streamed chat completions against the router's OpenAI API (SSE), one
    keep-alive connection per worker thread."""

    def __init__(self, base_url: str, timeout: float = 120.0):
        parts = urlsplit(base_url)
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout
        self._local = threading.local()

    def __call__(self, body: dict, abandon_after: int | None = None) -> Outcome:
        started = time.perf_counter()
        connection = self._connection()
        arrivals: list[float] = []

        def outcome(ok: bool, error: str = "", abandoned: bool = False) -> Outcome:
            return Outcome(ok, error, time.perf_counter() - started, tuple(arrivals), abandoned)

        try:
            reply = self._post(connection, json.dumps({**body, "stream": True}))
            if reply.status != 200:
                return outcome(False, f"HTTP {reply.status}: {reply.read()[:300]!r}")
            while True:
                line = reply.readline()
                if not line:
                    self._drop()
                    return outcome(False, "stream ended without [DONE]")
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    reply.read()  # the end of the chunked body, so the connection can carry the next request
                    return outcome(True)
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self._drop()
                    return outcome(False, str(chunk["error"]))
                arrivals.append(time.perf_counter() - started)
                if abandon_after is not None and len(arrivals) >= abandon_after:
                    self._drop()  # leave mid-stream: the router sees the connection close
                    return outcome(True, abandoned=True)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._drop()
            return outcome(False, f"{type(exc).__name__}: {exc}")

    def _post(self, connection: http.client.HTTPConnection, payload: str) -> http.client.HTTPResponse:
        """The reply to one POST; sent again on a new connection once if a kept-alive one was
        closed by the front meanwhile (before any answer: the request never reached it)."""
        reused = connection.sock is not None
        try:
            connection.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
            return connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            if not reused:
                raise
        self._drop()
        connection = self._connection()
        connection.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
        return connection.getresponse()

    def _connection(self) -> http.client.HTTPConnection:
        if getattr(self._local, "connection", None) is None:
            self._local.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._local.connection

    def _drop(self) -> None:
        connection, self._local.connection = getattr(self._local, "connection", None), None
        if connection is not None:
            connection.close()


class TritonStreams:
    """Streamed chat over tritonclient gRPC to a Triton model (`chat` or
    `chat_ensemble`), one client per worker thread."""

    def __init__(self, url: str, model: str = "chat"):
        self.url, self.model = url, model
        self._local = threading.local()
        self._clients: list[GrpcChat] = []
        self._lock = threading.Lock()

    def __call__(self, body: dict, abandon_after: int | None = None) -> Outcome:
        if getattr(self._local, "client", None) is None:
            self._local.client = GrpcChat(self.url, self.model)
            with self._lock:
                self._clients.append(self._local.client)
        started = time.perf_counter()
        arrivals: list[float] = []

        def outcome(ok: bool, error: str = "", abandoned: bool = False) -> Outcome:
            return Outcome(ok, error, time.perf_counter() - started, tuple(arrivals), abandoned)

        outputs = self._local.client.stream(chat_inputs({**body, "stream": True}))
        try:
            for output in outputs:
                arrivals.append(time.perf_counter() - started)
                if abandon_after is not None and len(arrivals) >= abandon_after:
                    return outcome(True, abandoned=True)
                if output.finish_reason:
                    return outcome(True)
            return outcome(False, "stream ended without a finish_reason")
        except ChatError as exc:
            return outcome(False, f"{exc.code.name}: {exc}")
        finally:
            outputs.close()  # an abandoned stream is cancelled on the server

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()


def run(
    send: Callable[[dict, int | None], Outcome],
    bodies: Callable[[int], dict],
    requests: int,
    concurrency: int,
    abandon_after: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Outcome]:
    """Send `requests` requests (body i = bodies(i)), `concurrency` at a time."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            outcome = send(bodies(index), abandon_after)
            with lock:
                outcomes.append(outcome)
                if progress is not None:
                    progress(len(outcomes), requests)

    threads = [threading.Thread(target=worker, name=f"load-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def summary(outcomes: list[Outcome], wall_s: float) -> dict[str, float]:
    """Request and output-token rates, errors, and TTFT / inter-token / whole-request
    percentiles (ms) of the requests that completed."""
    done = [o for o in outcomes if o.ok and not o.abandoned]
    ttft = sorted(o.ttft_s for o in done) or [0.0]
    gaps = sorted(g for o in done for g in o.gaps_s) or [0.0]
    latency = sorted(o.latency_s for o in done) or [0.0]
    return {
        "requests": len(outcomes),
        "errors": sum(not o.ok for o in outcomes),
        "req_per_s": len(done) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": sum(o.chunks for o in done) / wall_s if wall_s else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "latency_p50_ms": 1000 * statistics.median(latency),
        "latency_p99_ms": 1000 * percentile(latency, 99),
    }


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def first_errors(outcomes: list[Outcome], count: int = 5) -> list[str]:
    return [o.error for o in outcomes if not o.ok][:count]
