"""pdchat's metrics on Triton's metrics endpoint: forwarded-id outcomes and render
savings, decode requests and batch, KV held for pulls; and vLLM's engine metrics in vLLM's
names beside them (`VllmMetrics`, pdchat.core.engine_stats).

Every update goes through one lock per process: in Triton 2.51 two threads calling
`increment()` on one `pb_utils.Metric` corrupt the python backend's shared memory and
crash the server (`Metric::SendIncrementRequest` releases the GIL, then rewrites the
object's shared-memory members unlocked; see scripts/metric_race_repro). pdchat's
models update metrics from one thread each anyway; the lock keeps it safe by construction.
"""

from __future__ import annotations

import threading
import time

import triton_python_backend_utils as pb_utils

from pdchat.core import engine_stats
from pdchat.core.engine_stats import RequestTimeline, VllmMetric

_UPDATES = threading.Lock()


class _Metric:
    """A pb_utils Metric whose updates never overlap."""

    def __init__(self, family, labels: dict[str, str], buckets: tuple[float, ...] = ()):
        self._metric = family.Metric(labels=labels, buckets=list(buckets)) if buckets else family.Metric(labels=labels)

    def increment(self, value: float) -> None:
        with _UPDATES:
            self._metric.increment(value)

    def set(self, value: float) -> None:
        with _UPDATES:
            self._metric.set(value)

    def observe(self, value: float) -> None:
        with _UPDATES:
            self._metric.observe(value)


class RenderMetrics:
    """Chat prompts rendered (chat template + tokenizer), by the model that rendered them:
    chat renders short requests itself, the renderer the others and its own clients'."""

    def __init__(self, model_name: str):
        self._family = _counter(
            "pdchat_prompts_rendered_total", "Chat prompts rendered, by the model that rendered them"
        )
        self._rendered = _Metric(self._family, {"model": model_name})

    def rendered(self) -> None:
        self._rendered.increment(1)

    def close(self) -> None:
        del self._rendered, self._family


class HandoffMetrics:
    """The gate's outcomes and the render time they saved, and chat's own renders."""

    def __init__(self, model_name: str):
        self._labels = {"model": model_name}
        self._renders = RenderMetrics(model_name)
        # The families must outlive their metrics: keep references to both.
        self._outcomes = _counter(
            "pdchat_forwarded_ids_total", "Requests with forwarded prompt token ids, by outcome and rejection reason"
        )
        self._skipped_family = _counter(
            "pdchat_renders_skipped_total", "Renders (chat template + tokenization) skipped"
        )
        self._saved_family = _counter(
            "pdchat_render_seconds_saved_total",
            "Render seconds skipped, estimated from this host's measured render rate",
        )
        self._skipped = _Metric(self._skipped_family, self._labels)
        self._saved = _Metric(self._saved_family, self._labels)
        self._by_outcome: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def accepted(self, seconds_saved: float) -> None:
        self._outcome("accepted", "").increment(1)
        self._skipped.increment(1)
        self._saved.increment(seconds_saved)

    def rejected(self, reason: str) -> None:
        self._outcome("rejected", reason).increment(1)

    def rendered(self) -> None:
        self._renders.rendered()

    def close(self) -> None:
        """Drop metrics before their families, as the python backend requires."""
        self._renders.close()
        self._by_outcome.clear()
        del self._skipped, self._saved
        del self._outcomes, self._skipped_family, self._saved_family

    def _outcome(self, outcome: str, reason: str):
        with self._lock:
            key = (outcome, reason)
            if key not in self._by_outcome:
                self._by_outcome[key] = _Metric(self._outcomes, {**self._labels, "outcome": outcome, "reason": reason})
            return self._by_outcome[key]


class ParseMetrics:
    """Requests parsed, by the form they came in (request_json, text_input, or the canonical
    ChatRequest chat hands its renderer): a P/D request is parsed once per process."""

    def __init__(self, model_name: str):
        self._labels = {"model": model_name}
        self._family = _counter("pdchat_requests_parsed_total", "Chat requests parsed, by model and form")
        self._by_form: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def parsed(self, form: str) -> None:
        with self._lock:
            if form not in self._by_form:
                self._by_form[form] = _Metric(self._family, {**self._labels, "form": form})
            metric = self._by_form[form]
        metric.increment(1)

    def close(self) -> None:
        self._by_form.clear()
        del self._family


class DecodeMetrics:
    """How decode requests end (finished, cancelled, failed) and how many are running."""

    OUTCOMES = ("finished", "cancelled", "failed")

    def __init__(self, model_name: str):
        labels = {"model": model_name}
        self._ended_family = _counter("pdchat_decode_requests_total", "Decode requests by how they ended")
        self._active_family = pb_utils.MetricFamily(
            name="pdchat_decode_active", description="Decode requests in progress", kind=pb_utils.MetricFamily.GAUGE
        )
        self._pulls_family = _counter(
            "pdchat_kv_pulls_total", "KV handed over by prefill: pulled, or recomputed when the pull failed"
        )
        self._waiting_family = _gauge(
            "pdchat_decode_waiting", "Decode requests queued at the limits (max_running, KV budget)"
        )
        self._kv_family = _gauge("pdchat_decode_kv_bytes", "KV decode's running sequences hold now, by whole blocks")
        self._waiting = _Metric(self._waiting_family, labels)
        self._kv = _Metric(self._kv_family, labels)
        self._ended = {o: _Metric(self._ended_family, {**labels, "outcome": o}) for o in self.OUTCOMES}
        self._pulls = {o: _Metric(self._pulls_family, {**labels, "outcome": o}) for o in ("pulled", "recomputed")}
        self._active = _Metric(self._active_family, labels)

    def kv_pull(self, outcome: str) -> None:
        self._pulls[outcome].increment(1)

    def started(self) -> None:
        self._active.increment(1)

    def ended(self, outcome: str, was_active: bool = True) -> None:
        """A request ended; `was_active`: it had been admitted (started), not refused in the queue."""
        self._ended[outcome].increment(1)
        if was_active:
            self._active.increment(-1)

    def scheduler(self, waiting: int, kv_bytes: int) -> None:
        self._waiting.set(waiting)
        self._kv.set(kv_bytes)

    def close(self) -> None:
        """Drop metrics before their families, as the python backend requires."""
        self._ended.clear()
        self._pulls.clear()
        del self._active, self._waiting, self._kv
        del self._ended_family, self._active_family, self._pulls_family, self._waiting_family, self._kv_family


class KVHeldMetrics:
    """Bytes of KV a prefill instance holds for pulls, per connector (0 when all were pulled);
    one series per instance, each set by its own process."""

    def __init__(self, model_name: str, instance_name: str):
        self._family = pb_utils.MetricFamily(
            name="pdchat_kv_held_bytes",
            description="KV held for decode servers to pull",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self._labels = {"model": model_name, "instance": instance_name}
        self._by_connector: dict[str, object] = {}

    def update(self, held: dict[str, int]) -> None:
        for connector, size in held.items():
            if connector not in self._by_connector:
                self._by_connector[connector] = _Metric(self._family, {**self._labels, "connector": connector})
            self._by_connector[connector].set(size)

    def close(self) -> None:
        self._by_connector.clear()
        del self._family


class KVPoolMetrics:
    """A stage instance's KV block pool and prefix cache (core.generation.paged.PoolUsage):
    blocks used, cached and in all, the usage fraction, and in tokens the prompts looked
    up, the cache's hits and what prefill computed. One series per instance."""

    GAUGES = {
        "pdchat_kv_blocks_used": "KV blocks held by running sequences",
        "pdchat_kv_blocks_cached": "KV blocks kept for the prefix cache, unreferenced (evicted when room is needed)",
        "pdchat_kv_blocks_total": "KV blocks in the pool",
        "pdchat_kv_cache_usage": "Fraction of the KV pool's blocks held by running sequences",
    }
    COUNTERS = {
        "pdchat_prefix_cache_queries_tokens_total": "Prompt tokens looked up in the prefix cache",
        "pdchat_prefix_cache_hits_tokens_total": "Prompt tokens the prefix cache gave (not computed)",
        "pdchat_prompt_tokens_computed_total": "Prompt tokens computed by forward passes",
    }

    def __init__(self, model_name: str, instance_name: str):
        labels = {"model": model_name, "instance": instance_name}
        self._families = {name: _gauge(name, doc) for name, doc in self.GAUGES.items()}
        self._families.update({name: _counter(name, doc) for name, doc in self.COUNTERS.items()})
        self._metrics = {name: _Metric(family, labels) for name, family in self._families.items()}
        self._counted = dict.fromkeys(self.COUNTERS, 0)

    def update(self, usage) -> None:
        """Set the gauges and advance the counters to `usage` (a PoolUsage)."""
        values = {
            "pdchat_kv_blocks_used": usage.used_blocks,
            "pdchat_kv_blocks_cached": usage.cached_blocks,
            "pdchat_kv_blocks_total": usage.total_blocks,
            "pdchat_kv_cache_usage": usage.used_blocks / usage.total_blocks,
        }
        for name, value in values.items():
            self._metrics[name].set(value)
        totals = {
            "pdchat_prefix_cache_queries_tokens_total": usage.queried_tokens,
            "pdchat_prefix_cache_hits_tokens_total": usage.hit_tokens,
            "pdchat_prompt_tokens_computed_total": usage.computed_prompt_tokens,
        }
        for name, total in totals.items():
            if total > self._counted[name]:
                self._metrics[name].increment(total - self._counted[name])
                self._counted[name] = total

    def close(self) -> None:
        self._metrics.clear()
        self._families.clear()


class EngineInfo:
    """pdchat_engine_info{model, instance, path, device, dtype} 1: which execution path an
    instance's engine runs (core.engine_api.ExecutionPath: `path` is its label, e.g.
    `llama+c-kernels+greedy-head` or `transformers`), set once at load."""

    def __init__(self, model_name: str, instance_name: str, path):
        self._family = _gauge("pdchat_engine_info", "The execution path each stage instance's engine runs (always 1)")
        labels = {"model": model_name, "instance": instance_name, "path": path.label()}
        self._info = _Metric(self._family, {**labels, "device": path.device, "dtype": path.dtype})
        self._info.set(1)

    def close(self) -> None:
        del self._info, self._family


class VllmMetrics:
    """vLLM's engine metrics for one prefill or decode instance (an "engine"), labels
    `model_name` (the first served name) and `engine` (the instance): what dashboards,
    scorers and autoscalers written for vLLM read. Histograms are Triton's (the python
    backend's MetricFamily.HISTOGRAM, Triton 2.51). Call from one thread (the outbox);
    `now` is time.monotonic()'s.

    The feeds: `pool` (a PoolUsage, where KVPoolMetrics gets it), `requests` (running,
    waiting), and per request `arrived`, `admitted`, `emitted` (an output of `sampled`
    tokens computed here), `ended`."""

    _KINDS = {"gauge": "GAUGE", "counter": "COUNTER", "histogram": "HISTOGRAM"}
    _FLUSH_S = 0.1
    _TOKEN_COUNTS = (engine_stats.REQUEST_PROMPT_TOKENS, engine_stats.REQUEST_GENERATION_TOKENS)

    def __init__(self, served_name: str, instance_name: str, context_length: int):
        labels = {"model_name": served_name, "engine": instance_name}
        self._families = {
            spec.name: pb_utils.MetricFamily(
                name=spec.name, description=spec.doc, kind=getattr(pb_utils.MetricFamily, self._KINDS[spec.kind])
            )
            for spec in engine_stats.VLLM_METRICS
        }
        token_buckets = engine_stats.request_token_buckets(context_length)
        self._metrics = {
            spec.name: _Metric(
                self._families[spec.name], labels, token_buckets if spec in self._TOKEN_COUNTS else spec.buckets
            )
            for spec in engine_stats.VLLM_METRICS
            if spec is not engine_stats.SUCCESS
        }
        self._success = {
            reason: _Metric(self._families[engine_stats.SUCCESS.name], {**labels, "finished_reason": reason})
            for reason in engine_stats.FINISH_REASONS
        }
        self._timeline = RequestTimeline()
        self._counted = {"prompt": 0, "queries": 0, "hits": 0}
        # Generation tokens not yet added to their counter: added at most every
        # _FLUSH_S while streams run, and whenever a request ends (so none is ever lost).
        self._unsent_tokens = 0
        self._sent_at = float("-inf")

    def pool(self, usage) -> None:
        """KV usage, and the prefix cache's and prompts' counters advanced to `usage`'s totals."""
        self._metric(engine_stats.KV_USAGE).set(usage.used_blocks / usage.total_blocks)
        totals = {
            "prompt": usage.computed_prompt_tokens + usage.hit_tokens,
            "queries": usage.queried_tokens,
            "hits": usage.hit_tokens,
        }
        specs = {
            "prompt": engine_stats.PROMPT_TOKENS,
            "queries": engine_stats.PREFIX_QUERIES,
            "hits": engine_stats.PREFIX_HITS,
        }
        for key, total in totals.items():
            if total > self._counted[key]:
                self._metric(specs[key]).increment(total - self._counted[key])
                self._counted[key] = total

    def requests(self, running: int, waiting: int) -> None:
        self._metric(engine_stats.RUNNING).set(running)
        self._metric(engine_stats.WAITING).set(waiting)

    def arrived(self, key: str, now: float, prompt_tokens: int) -> None:
        self._timeline.arrived(key, now, prompt_tokens)

    def admitted(self, key: str, now: float | None = None) -> None:
        """`key` entered the engine's batch (the end of its queue time)."""
        self._timeline.admitted(key, time.monotonic() if now is None else now)

    @property
    def in_flight(self) -> int:
        """Requests arrived and not ended."""
        return len(self._timeline)

    def emitted(self, key: str, sampled: int, now: float | None = None) -> None:
        """An output of `key`, of which `sampled` tokens were sampled by this engine."""
        now = time.monotonic() if now is None else now
        observed = self._timeline.emitted(key, now, sampled)
        if observed is not None:
            self._metric(observed[0]).observe(observed[1])
        self._unsent_tokens += sampled
        if now - self._sent_at >= self._FLUSH_S:
            self._send_tokens(now)

    def ended(self, key: str, finish_reason: str | None, now: float | None = None) -> None:
        """`key` ended: finished for `finish_reason` (stop, length), or failed or cancelled (None)."""
        now = time.monotonic() if now is None else now
        self._send_tokens(now)
        if finish_reason is None:
            self._timeline.dropped(key)
            return
        request = self._timeline.finished(key, now, finish_reason)
        if request is None:
            return
        self._success[finish_reason].increment(1)
        for spec, value in (
            (engine_stats.E2E, request.e2e),
            (engine_stats.QUEUE_TIME, request.queued),
            (engine_stats.PREFILL_TIME, request.prefill),
            (engine_stats.DECODE_TIME, request.decode),
            (engine_stats.INFERENCE_TIME, request.inference),
            (engine_stats.TPOT, request.time_per_output),
            (engine_stats.REQUEST_PROMPT_TOKENS, request.prompt_tokens),
            (engine_stats.REQUEST_GENERATION_TOKENS, request.generation_tokens),
        ):
            self._metric(spec).observe(value)

    def _send_tokens(self, now: float) -> None:
        if self._unsent_tokens > 0:
            self._metric(engine_stats.GENERATION_TOKENS).increment(self._unsent_tokens)
            self._unsent_tokens = 0
        self._sent_at = now

    def close(self) -> None:
        """Drop metrics before their families, as the python backend requires."""
        self._metrics.clear()
        self._success.clear()
        self._families.clear()

    def _metric(self, spec: VllmMetric) -> _Metric:
        return self._metrics[spec.name]


def _gauge(name: str, description: str):
    return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)


def _counter(name: str, description: str):
    return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.COUNTER)


class DecodeServerMetrics:
    """Every metric of one decode instance, in pdchat's names and vLLM's: its streams'
    observer (core.output.decode_streams.StreamObserver), the engine's state and pool, KV
    pulls and the engine's path (EngineInfo). Call from the outbox thread."""

    def __init__(self, model_name: str, instance_name: str, served_name: str, path, context_length: int):
        self.decode = DecodeMetrics(model_name)
        self.pool = KVPoolMetrics(model_name, instance_name)
        self.vllm = VllmMetrics(served_name, instance_name, context_length)  # vLLM's names
        self.info = EngineInfo(model_name, instance_name, path)

    def arrived(self, key: str, now: float, prompt_tokens: int) -> None:
        self.vllm.arrived(key, now, prompt_tokens)

    def started(self, key: str) -> None:
        self.decode.started()
        self.vllm.admitted(key)

    def emitted(self, key: str, tokens: int) -> None:
        self.vllm.emitted(key, tokens)

    def ended(self, key: str, outcome: str, started: bool, finish_reason: str | None = None) -> None:
        self.decode.ended(outcome, started)
        self.vllm.ended(key, finish_reason if outcome == "finished" else None)

    def kv_pull(self, outcome: str) -> None:
        self.decode.kv_pull(outcome)

    def state(self, state, usage) -> None:
        """The engine's state (core.engine_api.EngineState) and its pool's usage."""
        self.decode.scheduler(state.waiting, state.kv_bytes)
        self.pool.update(usage)
        self.vllm.pool(usage)
        self.vllm.requests(state.running, state.waiting)

    def close(self) -> None:
        for part in (self.decode, self.pool, self.vllm, self.info):
            part.close()
