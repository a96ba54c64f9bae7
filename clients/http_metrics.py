"""The HTTP front's Prometheus metrics (`GET /metrics`), in a registry of its own per app.

Chat requests by outcome (OUTCOMES) and in flight, error answers by status and code,
time to the first chunk and between chunks of streamed answers, and the router's own
counters, read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from pdchat.clients.http_errors import ApiError

if TYPE_CHECKING:
    from pdchat.clients.fronts import ChatFront

OUTCOMES = ("ok", "client_error", "server_error", "cancelled")


class FrontMetrics:
    """The front's metrics: counted by the routes, the SSE streams and the guard."""

    def __init__(self, router: ChatFront):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdchat_router_requests", "Chat completion requests, by how they ended", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.errors = Counter(
            "pdchat_router_errors",
            "Error answers (streamed ones too), by HTTP status and error code",
            ["status", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pdchat_router_requests_in_flight", "Chat completion requests being served", registry=self.registry
        )
        self.ttft = Histogram(
            "pdchat_router_ttft_seconds",
            "Streamed requests: from the request to its first chunk",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "pdchat_router_inter_token_seconds",
            "Streamed requests: between consecutive chunks",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.registry.register(_RouterStatsCollector(router))

    def count_error(self, error: ApiError) -> None:
        """An error answered, as a response or as a streamed chunk."""
        self.errors.labels(str(error.status), error.code).inc()

    def page(self) -> bytes:
        return generate_latest(self.registry)


class _RouterStatsCollector:
    """Reads the router's own counters at scrape time, so the router needs no Prometheus."""

    def __init__(self, router: ChatFront):
        self.router = router

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "pdchat_router_prefill_fallbacks",
            "Requests decode served whole because prefill failed",
            value=self.router.stats.prefill_fallbacks,
        )
