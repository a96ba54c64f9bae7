"""vLLM's engine metrics: the per-request timeline and the documented mapping."""

from __future__ import annotations

from pathlib import Path

from pdchat.core.engine_stats import (
    E2E,
    ITL,
    TTFT,
    VLLM_METRICS,
    FinishedRequest,
    RequestTimeline,
    request_token_buckets,
)

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"


def test_the_first_output_is_ttft_the_next_ones_itl_and_the_end_a_finished_requests_figures():
    timeline = RequestTimeline()
    timeline.arrived("a", 10.0, prompt_tokens=300)
    timeline.arrived("b", 10.5)
    assert len(timeline) == 2
    timeline.admitted("a", 10.1)
    assert timeline.emitted("a", 10.25, sampled=0) == (TTFT, 0.25)  # prefill's first token
    assert timeline.emitted("a", 10.75, sampled=2) == (ITL, 0.5)
    assert timeline.emitted("a", 11.0, sampled=1) == (ITL, 0.25)
    finished = timeline.finished("a", 11.5, "length")
    assert finished == FinishedRequest(
        finish_reason="length",
        e2e=1.5,
        queued=10.1 - 10.0,
        prefill=10.25 - 10.1,
        decode=0.75,
        prompt_tokens=300,
        generation_tokens=3,
        outputs=3,
    )
    assert finished.inference == finished.prefill + finished.decode and finished.time_per_output == 0.375
    timeline.dropped("b")  # cancelled: no latency
    assert len(timeline) == 0
    assert timeline.emitted("b", 12.0) is None and timeline.finished("b", 12.0, "stop") is None
    assert E2E.kind == "histogram" and E2E.buckets == tuple(sorted(E2E.buckets))


def test_a_request_never_admitted_apart_nor_emitting_ends_with_zero_phases():
    timeline = RequestTimeline()
    timeline.arrived("p", 5.0, prompt_tokens=7)
    finished = timeline.finished("p", 5.5, "stop")
    assert (finished.queued, finished.prefill, finished.decode, finished.outputs) == (0.0, 0.5, 0.0, 0)
    assert finished.time_per_output == 0.0


def test_request_token_buckets_are_vllms_1_2_5_series_up_to_the_context():
    assert request_token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert request_token_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_every_vllm_metric_is_in_the_deployment_table_once():
    text = DEPLOYMENT.read_text()
    for spec in VLLM_METRICS:
        assert text.count(f"| `{spec.name}` | {spec.kind} |") == 1, spec.name
