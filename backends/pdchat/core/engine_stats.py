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
# Per finished request, as vLLM's FinishedRequestStats: what its dashboards' finish-reason,
# length and phase panels read. The token-count histograms take `request_token_buckets`.
SUCCESS = VllmMetric(
    "vllm:request_success_total", "counter", "Finished requests, by finish reason (label finished_reason)"
)
REQUEST_PROMPT_TOKENS = VllmMetric(
    "vllm:request_prompt_tokens", "histogram", "Prompt length of each finished request, in tokens"
)
REQUEST_GENERATION_TOKENS = VllmMetric(
    "vllm:request_generation_tokens",
    "histogram",
    "Output tokens this engine sampled for each finished request",
)
QUEUE_TIME = VllmMetric(
    "vllm:request_queue_time_seconds",
    "histogram",
    "From a finished request's arrival to its admission into the engine's batch",
    E2E_BUCKETS,
)
PREFILL_TIME = VllmMetric(
    "vllm:request_prefill_time_seconds",
    "histogram",
    "From a finished request's admission to its first output",
    E2E_BUCKETS,
)
DECODE_TIME = VllmMetric(
    "vllm:request_decode_time_seconds",
    "histogram",
    "From a finished request's first output to its last",
    E2E_BUCKETS,
)
INFERENCE_TIME = VllmMetric(
    "vllm:request_inference_time_seconds",
    "histogram",
    "From a finished request's admission to its last output",
    E2E_BUCKETS,
)
TPOT = VllmMetric(
    "vllm:request_time_per_output_token_seconds",
    "histogram",
    "A finished request's decode time over its outputs after the first",
    ITL_BUCKETS,
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
    SUCCESS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    QUEUE_TIME,
    PREFILL_TIME,
    DECODE_TIME,
    INFERENCE_TIME,
    TPOT,
)
# vLLM's finished_reason label values a finished pdchat request takes (a delta's finish_reason;
# a tool call's end is a stop, as on vLLM's engine).
FINISH_REASONS = ("stop", "length")


def request_token_buckets(context_length: int) -> tuple[float, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to the context."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > context_length:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True)
class FinishedRequest:
    """One finished request's figures, in vLLM's FinishedRequestStats' terms (seconds, tokens)."""

    finish_reason: str
    e2e: float
    queued: float
    prefill: float  # admission to first output
    decode: float  # first output to last
    prompt_tokens: int
    generation_tokens: int  # sampled by this engine
    outputs: int

    @property
    def inference(self) -> float:
        return self.prefill + self.decode

    @property
    def time_per_output(self) -> float:
        """Decode time over the outputs after the first (0 with one output), as vLLM's mean TPOT."""
        return self.decode / (self.outputs - 1) if self.outputs > 1 else 0.0


@dataclass
class _Times:
    arrived: float
    prompt_tokens: int
    admitted: float | None = None  # None: admitted on arrival
    first: float | None = None  # the first output
    last: float | None = None  # the latest output
    outputs: int = 0
    sampled: int = 0


@dataclass
class RequestTimeline:
    """Each request's arrival, admission and outputs, for the latency histograms and each
    finished request's figures. Times are a monotonic clock's seconds; a key unknown here
    (never arrived) observes nothing."""

    _times: dict[str, _Times] = field(default_factory=dict)

    def __len__(self) -> int:
        """Requests arrived and not ended."""
        return len(self._times)

    def arrived(self, key: str, at: float, prompt_tokens: int = 0) -> None:
        self._times[key] = _Times(at, prompt_tokens)

    def admitted(self, key: str, at: float) -> None:
        """`key` entered the engine's batch (a request never admitted counts as admitted on arrival)."""
        if (times := self._times.get(key)) is not None:
            times.admitted = at

    def emitted(self, key: str, at: float, sampled: int = 0) -> tuple[VllmMetric, float] | None:
        """An output at `at`, of which `sampled` tokens this engine sampled: (TTFT, seconds since
        arrival) for the first, (ITL, seconds since the previous) after it."""
        times = self._times.get(key)
        if times is None:
            return None
        previous, times.last = times.last, at
        times.outputs += 1
        times.sampled += sampled
        if previous is None:
            times.first = at
            return TTFT, at - times.arrived
        return ITL, at - previous

    def finished(self, key: str, at: float, finish_reason: str) -> FinishedRequest | None:
        """The figures of a request that finished at `at` (it is forgotten)."""
        times = self._times.pop(key, None)
        if times is None:
            return None
        admitted = times.arrived if times.admitted is None else times.admitted
        first = at if times.first is None else times.first
        last = at if times.last is None else times.last
        return FinishedRequest(
            finish_reason=finish_reason,
            e2e=at - times.arrived,
            queued=admitted - times.arrived,
            prefill=max(first - admitted, 0.0),
            decode=last - first,
            prompt_tokens=times.prompt_tokens,
            generation_tokens=times.sampled,
            outputs=times.outputs,
        )

    def dropped(self, key: str) -> None:
        """A request that failed or was cancelled: forgotten, no latency observed (as vLLM)."""
        self._times.pop(key, None)
