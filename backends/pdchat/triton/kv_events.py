"""KV events of a prefill or decode instance (pdchat.core.kv_events) from its settings,
and their counts on Triton's metrics endpoint.

One publisher per model instance: instance i of a model (the index Triton ends its
instance name with) publishes on its role's endpoint offset by i (tcp: the port + i;
ipc/inproc: the address + `_i`), its replay socket likewise, and puts i in each batch's
data_parallel_rank, as vLLM does per data-parallel rank.
"""

from __future__ import annotations

import logging
import re

from pdchat.core.errors import ModelUnavailable
from pdchat.core.generation.paged import BlockPool
from pdchat.core.kv_events import BlockEvents, KVEventPublisher, PublisherStats, instance_endpoint
from pdchat.core.settings import kv_events_options
from pdchat.triton.metrics import _counter, _Metric

log = logging.getLogger(__name__)


def instance_index(instance_name: str) -> int:
    """The index Triton ends an instance's name with ("decode_0_1" -> 1); 0 if none."""
    match = re.search(r"_(\d+)$", instance_name)
    return int(match.group(1)) if match else 0


class KVEvents:
    """A pool's KV events publisher, or nothing when its role's endpoint is unset.
    Call close() at finalize (either way)."""

    def __init__(self, role: str, parameters: dict[str, str], args: dict, pool: BlockPool | None):
        self._publisher: KVEventPublisher | None = None
        self._metrics: _EventMetrics | None = None
        options = kv_events_options(role, parameters)
        if options is None or pool is None:  # off, or an engine that publishes its own (vLLM's)
            return
        index = instance_index(args["model_instance_name"])
        endpoint = instance_endpoint(options.endpoint, index)
        replay = instance_endpoint(options.replay_endpoint, index)
        self._metrics = _EventMetrics(args["model_name"], args["model_instance_name"])
        sink = BlockEvents()
        try:
            self._publisher = KVEventPublisher(
                sink,
                endpoint=endpoint,
                replay_endpoint=replay,
                block_size=pool.block_tokens,
                topic=options.topic,
                buffer_steps=options.buffer_steps,
                rank=index,
                layout=options.layout,
                curve_dir=options.curve_dir,
                on_stats=self._metrics.update,
            )
        except Exception as exc:
            self._metrics.close()
            raise ModelUnavailable(f"{role}'s KV events cannot publish on {endpoint} / replay {replay}: {exc}") from exc
        pool.events = sink
        log.info(
            "%s: KV events on %s (replay %s), topic %r", args["model_instance_name"], endpoint, replay, options.topic
        )

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
        if self._metrics is not None:
            self._metrics.close()


class _EventMetrics:
    """pdchat_kv_events_published_total and pdchat_kv_events_dropped_total (reason queue:
    events the queue had no room for; subscriber: messages a full subscriber queue
    refused, kept for replay), labels model and instance."""

    def __init__(self, model_name: str, instance_name: str):
        labels = {"model": model_name, "instance": instance_name}
        self._published_family = _counter("pdchat_kv_events_published_total", "KV events messages published")
        self._dropped_family = _counter(
            "pdchat_kv_events_dropped_total",
            "KV events lost: events past the queue (reason queue), messages a slow subscriber refused (subscriber)",
        )
        self._published = _Metric(self._published_family, labels)
        self._queue = _Metric(self._dropped_family, {**labels, "reason": "queue"})
        self._subscriber = _Metric(self._dropped_family, {**labels, "reason": "subscriber"})
        self._counted = PublisherStats(0, 0, 0)

    def update(self, stats: PublisherStats) -> None:
        """From the publisher thread: add what changed since the last call."""
        before, self._counted = self._counted, stats
        for metric, now, then in (
            (self._published, stats.published, before.published),
            (self._queue, stats.dropped_events, before.dropped_events),
            (self._subscriber, stats.dropped_messages, before.dropped_messages),
        ):
            if now > then:
                metric.increment(now - then)

    def close(self) -> None:
        """Drop metrics before their families, as the python backend requires."""
        del self._published, self._queue, self._subscriber
        del self._published_family, self._dropped_family
