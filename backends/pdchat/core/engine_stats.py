"""vLLM's engine metrics, as pdchat's stage models report them: which names, and the
per-request timeline behind the latency histograms. No Triton import: `pdchat.triton.metrics`
turns these into Triton metric families (`VllmMetrics`), on each server's metrics port.

Each prefill or decode model instance is one vLLM "engine": its series carry vLLM's label
`model_name` (the first served name) and `engine` (the Triton instance), so a monolithic
server, which runs both, shows two engines whose sums count each token once: a token counts
where it was computed (prompt tokens where they were prefilled, the first output token on
prefill, the rest on decode). docs/deployment.md#engine-metrics-in-vllms-names maps each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)

Kind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class VllmMetric:
    name: str
    kind: Kind
    doc: str
    buckets: tuple[float, ...] = ()


RUNNING = VllmMetric(
    "vllm:num_requests_running",
    "gauge",
    "Requests in this engine's batch (decode: running and prefilling; prefill: in progress, a pass at a time)",
)
WAITING = VllmMetric(
    "vllm:num_requests_waiting",
    "gauge",
    "Requests queued for this engine (decode: at max_running or the KV budget; prefill: waiting for KV room)",
)
KV_USAGE = VllmMetric(
    "vllm:kv_cache_usage_perc", "gauge", "Fraction of the engine's KV blocks held by running sequences (1 = full)"
)
PROMPT_TOKENS = VllmMetric(
    "vllm:prompt_tokens_total", "counter", "Prompt tokens this engine prefilled: computed, or given by its prefix cache"
)
GENERATION_TOKENS = VllmMetric("vllm:generation_tokens_total", "counter", "Output tokens this engine sampled")
PREFIX_QUERIES = VllmMetric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = VllmMetric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens the prefix cache gave")
TTFT = VllmMetric(
    "vllm:time_to_first_token_seconds",
    "histogram",
    "From a request's arrival at this engine to its first output token",
    TTFT_BUCKETS,
)
ITL = VllmMetric(
    "vllm:inter_token_latency_seconds", "histogram", "Between a request's consecutive outputs", ITL_BUCKETS
)
E2E = VllmMetric(
    "vllm:e2e_request_latency_seconds",
    "histogram",
    "From a request's arrival at this engine to its end (finished requests)",
    E2E_BUCKETS,
)
VLLM_METRICS = (
    RUNNING,
    WAITING,
    KV_USAGE,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_QUERIES,
    PREFIX_HITS,
    TTFT,
    ITL,
    E2E,
)


@dataclass
class _Times:
    arrived: float
    last: float | None = None  # the latest output


@dataclass
class RequestTimeline:
    """Each request's arrival and latest output, for TTFT, inter-token and end-to-end latency.
    Times are a monotonic clock's seconds; a key unknown here (never arrived) observes nothing."""

    _times: dict[str, _Times] = field(default_factory=dict)

    def __len__(self) -> int:
        """Requests arrived and not ended."""
        return len(self._times)

    def arrived(self, key: str, at: float) -> None:
        self._times[key] = _Times(at)

    def emitted(self, key: str, at: float) -> tuple[VllmMetric, float] | None:
        """An output at `at`: (TTFT, seconds since arrival) for the first, (ITL, seconds since
        the previous) after it."""
        times = self._times.get(key)
        if times is None:
            return None
        previous, times.last = times.last, at
        return (TTFT, at - times.arrived) if previous is None else (ITL, at - previous)

    def finished(self, key: str, at: float) -> float | None:
        """The end-to-end seconds of a request that finished at `at` (it is forgotten)."""
        times = self._times.pop(key, None)
        return None if times is None else at - times.arrived

    def dropped(self, key: str) -> None:
        """A request that failed or was cancelled: forgotten, no latency observed (as vLLM)."""
        self._times.pop(key, None)
