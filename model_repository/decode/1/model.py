"""decode (decoupled): sealed prompt ids + prefill's KV and first token -> streamed answer.

Without KV it prefills locally, in chunks between decode steps; a KV handle it cannot
pull (expired, prefill gone) is recomputed from the ids, never re-rendered; the KV of a
request that ends before decode pulled it (cancelled, failed or expired in the queue) is
discarded at once (KVHandover), not left to its TTL. The engine (core.engine_api; pdchat's
advances all running requests in one forward pass per step) decodes; execute() only
validates and queues. Every call into the server (responses, errors, cancel
acknowledgements, cancellation checks, metrics) runs on the outbox thread
(pdchat.triton.outbox), in order, while the engine's thread runs the next forward pass.
A request carrying only `cancel_request_id` (sealed by chat) stops the named request instead.
With `first_output_sent` (and a KV handle), its client has the stream's first output from
prefill already (TextModel.first_output): decode makes it too, and does not send it.
"""

import functools
import logging
import os
import time

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.engine_api import DECODE, DecodeCallbacks, DecodeRequest, EngineHooks
from pdchat.core.engines import open_engine
from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.sampling import Choice
from pdchat.core.kv.connector import Connectors, KVHandover, KVUnavailable
from pdchat.core.output.decode_streams import DecodeStream, DecodeStreams
from pdchat.core.output.feeds import DecodeFeeds
from pdchat.core.settings import batching_options, keep_off_decode_cpus, kv_options
from pdchat.ensemble.decode_load import LoadSlot
from pdchat.ensemble.seal import StageSeal, server_directory
from pdchat.models import resolve_model
from pdchat.triton import io
from pdchat.triton.kv_events import KVEvents
from pdchat.triton.metrics import DecodeMetrics, EngineInfo, KVPoolMetrics, StreamMetrics, VllmMetrics
from pdchat.triton.outbox import Outbox
from pdchat.triton.server_watch import exit_with_server

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("pdchat.decode")


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        cpus = keep_off_decode_cpus(parameters)  # the scheduler thread takes cpus.decode
        kind, device_id = io.instance_placement(args)
        if kind == "GPU" and device_id > 0:
            log.warning(
                "decode runs an instance per GPU here; chat's cancellations reach the instance they land on, "
                "not always the request's: run a server per GPU (CUDA_VISIBLE_DEVICES)"
            )
        settings = resolve_model(parameters).on_instance(kind, device_id)
        self.engine = open_engine(DECODE, settings, parameters, args["model_instance_name"], cpus)
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: {self.engine.path.describe()}")
        self.engine_info = EngineInfo(args["model_name"], args["model_instance_name"], self.engine.path)
        self.seal = StageSeal.for_this_server()
        self.connectors = Connectors(**kv_options(parameters))
        self.kv_events = KVEvents("decode", parameters, args, self.engine.kv_pool)  # off unless its endpoint is set
        self.metrics = DecodeMetrics(args["model_name"])
        self.pool_metrics = KVPoolMetrics(args["model_name"], args["model_instance_name"])
        self.vllm_metrics = VllmMetrics(settings.served_name, args["model_instance_name"])  # vLLM's names
        # About one step's responses may wait for the outbox before the engine waits too.
        self.outbox = Outbox("pdchat-decode-outbox", max_pending=2 * batching_options(parameters).max_running)
        self.feeds = DecodeFeeds(io.StreamTransport(), on_closed=self.outbox.unwatch)  # on the outbox thread
        # What chat reads to let an idle decode prefill a prompt itself (setting local_prefill_when_idle).
        capacity = self.engine.kv_capacity_tokens
        self.load = LoadSlot(server_directory(os.getppid()), args["model_instance_name"], capacity)
        self.streams = DecodeStreams(
            io.StreamTransport(),
            StreamMetrics(self.metrics, self.vllm_metrics),
            self.feeds,
            cancel=self.engine.cancel,
            unwatch=self.outbox.unwatch,
        )
        self.engine.start(
            EngineHooks(
                on_state=self._on_state,
                on_load=self.load.set,
                on_emitted=functools.partial(self.outbox.call, self.feeds.flush),
            )
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                feed = io.feed_opened(request)
                if feed is not None:
                    self.seal.check_feed(feed, io.input_text(request, tensors.STAGE_SEAL))
                    self.outbox.call(functools.partial(self._open_feed, feed, sender))
                    continue
                cancel = io.input_text(request, tensors.CANCEL_REQUEST_ID)
                if cancel is not None:
                    self.seal.check_cancel(cancel, io.input_text(request, tensors.STAGE_SEAL))
                    self.engine.cancel(cancel)
                    self.outbox.call(functools.partial(sender.send, flags=FINAL))
                    continue
                self._decode(request, sender)
            except Exception as exc:  # noqa: BLE001
                self.outbox.call(functools.partial(sender.send, io.error_response(exc), flags=FINAL))
        return None

    def finalize(self):
        self.engine.close()
        self.load.close()
        self.kv_events.close()
        self.engine_info.close()
        self.outbox.call(self.feeds.close_all)
        self.outbox.close()
        self.connectors.close()
        self.metrics.close()
        self.pool_metrics.close()
        self.vllm_metrics.close()

    def _decode(self, request, sender) -> None:
        """Hand the request to the engine, with its stream's callbacks."""
        engine = self.engine
        stage = io.stage_input(request, self.seal, engine.context_length, engine.vocab_size)
        # Prefill's KV and first token come only inside a sealed handle; without one decode prefills.
        kv = None if stage.kv_handle is None else KVHandover(self.connectors, stage.kv_handle)
        try:
            self._sealed_decode(request, sender, stage, kv)
        except BaseException:
            if kv is not None:
                kv.end()  # refused here: its KV is freed now
            raise

    def _sealed_decode(self, request, sender, stage, kv: KVHandover | None) -> None:
        engine = self.engine
        ids, params, handle = stage.prompt_token_ids, stage.params, stage.kv_handle
        first = None if handle is None else Choice(handle.first_token_id, handle.first_token_logprobs)
        if first is not None and not 0 <= first.token_id < engine.vocab_size:
            raise InvalidRequest(f"the KV handle's first token {first.token_id} is not in this model's vocabulary")
        # The client has prefill's first output already: decode's first delta is not sent again.
        first_sent = first is not None and bool(io.input_scalar(request, tensors.FIRST_OUTPUT_SENT))
        feed, feed_key = io.feed_named(request)
        stream = DecodeStream(
            params.request_id,
            sender,
            engine.assembler(ids, params, first_output_sent=first_sent),
            io.requested_client_outputs(request),
            io.heartbeat_s(request),
            given_first=first is not None,
            kv=kv,
            feed=feed,
            feed_key=feed_key,
        )
        self.outbox.call(functools.partial(self.vllm_metrics.arrived, stream.key, time.monotonic()))

        self.outbox.watch(stream, sender.is_cancelled, functools.partial(self._client_left, stream))
        engine.decode(
            DecodeRequest(
                stream.key,
                ids,
                params,
                first=first,
                kv_source=None if kv is None else functools.partial(self._pull, kv, params.request_id),
                on_kv_released=None if kv is None else kv.done,
                # A pull that waits on the network (NIXL) runs before the request joins, off the engine's thread.
                prefetch_kv=kv.prefetch if kv is not None and kv.pull_waits else None,
                cached_tokens=0 if handle is None else handle.cached_tokens,
            ),
            DecodeCallbacks(
                started=functools.partial(self._on_outbox, self.streams.started, stream),
                emit=functools.partial(self._on_outbox, self.streams.send, stream),
                fail=functools.partial(self._on_outbox, self.streams.close, stream, "failed"),
                cancelled=functools.partial(self._on_outbox, self.streams.close, stream, "cancelled"),
            ),
        )

    def _on_outbox(self, function, *args) -> None:
        """From the engine's thread: `function(*args)` on the outbox thread, in order."""
        self.outbox.call(functools.partial(function, *args))

    def _on_state(self, state) -> None:
        self.outbox.call(functools.partial(self.metrics.scheduler, state.waiting, state.kv_bytes))
        usage = self.engine.pool_usage()
        self.outbox.call(functools.partial(self.pool_metrics.update, usage))
        self.outbox.call(functools.partial(self.vllm_metrics.pool, usage))
        self.outbox.call(functools.partial(self.vllm_metrics.requests, state.running, state.waiting))

    # On the outbox thread:

    def _client_left(self, stream: DecodeStream) -> None:
        stream.left = True
        self.engine.cancel(stream.key)

    def _open_feed(self, feed: str, sender) -> None:
        if self.feeds.open(feed, sender):
            self.outbox.watch(feed, sender.is_cancelled, functools.partial(self.feeds.close, feed))

    def _pull(self, handover: KVHandover, request_id, start_token):
        """The KV a handle names, of its tokens from `start_token` on (those before are in
        decode's prefix cache), or None (decode then recomputes it from the ids)."""
        try:
            kv = handover.pull(start_token)
        except KVUnavailable as exc:
            log.warning("request %s: KV pull failed, recomputing prefill from the forwarded ids: %s", request_id, exc)
            self.outbox.call(functools.partial(self.metrics.kv_pull, "recomputed"))
            return None
        self.outbox.call(functools.partial(self.metrics.kv_pull, "pulled"))
        return kv
