"""vLLM's engine metrics: the per-request timeline and the documented mapping."""

from __future__ import annotations

from pathlib import Path

from pdchat.core.engine_stats import E2E, ITL, TTFT, VLLM_METRICS, RequestTimeline

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"


def test_the_first_output_is_ttft_the_next_ones_itl_and_the_end_e2e():
    timeline = RequestTimeline()
    timeline.arrived("a", 10.0)
    timeline.arrived("b", 10.5)
    assert len(timeline) == 2
    assert timeline.emitted("a", 10.25) == (TTFT, 0.25)
    assert timeline.emitted("a", 10.75) == (ITL, 0.5)
    assert timeline.emitted("a", 11.0) == (ITL, 0.25)
    assert timeline.finished("a", 11.5) == 1.5
    timeline.dropped("b")  # cancelled: no latency
    assert len(timeline) == 0
    assert timeline.emitted("b", 12.0) is None and timeline.finished("b", 12.0) is None
    assert E2E.kind == "histogram" and E2E.buckets == tuple(sorted(E2E.buckets))


def test_every_vllm_metric_is_in_the_deployment_table_once():
    text = DEPLOYMENT.read_text()
    for spec in VLLM_METRICS:
        assert text.count(f"| `{spec.name}` | {spec.kind} |") == 1, spec.name
