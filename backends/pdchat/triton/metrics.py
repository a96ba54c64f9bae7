"""Forwarded-id outcomes and render savings on Triton's metrics endpoint."""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils


class HandoffMetrics:
    def __init__(self, model_name: str):
        self._labels = {"model": model_name}
        # The families must outlive their metrics: keep references to both.
        self._outcomes = _counter("pdchat_forwarded_ids_total", "Requests with forwarded prompt token ids, by outcome and rejection reason")
        self._skipped_family = _counter("pdchat_renders_skipped_total", "Renders (chat template + tokenization) skipped")
        self._saved_family = _counter("pdchat_render_seconds_saved_total", "Render seconds skipped, estimated from this host's measured render rate")
        self._skipped = self._skipped_family.Metric(labels=self._labels)
        self._saved = self._saved_family.Metric(labels=self._labels)
        self._by_outcome: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def accepted(self, seconds_saved: float) -> None:
        self._outcome("accepted", "").increment(1)
        self._skipped.increment(1)
        self._saved.increment(seconds_saved)

    def rejected(self, reason: str) -> None:
        self._outcome("rejected", reason).increment(1)

    def _outcome(self, outcome: str, reason: str):
        with self._lock:
            key = (outcome, reason)
            if key not in self._by_outcome:
                self._by_outcome[key] = self._outcomes.Metric(labels={**self._labels, "outcome": outcome, "reason": reason})
            return self._by_outcome[key]


def _counter(name: str, description: str):
    return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.COUNTER)
