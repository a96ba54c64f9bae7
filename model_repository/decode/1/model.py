"""decode (decoupled): sealed prompt ids + prefill's KV and first token -> streamed answer.

execute() checks each request's seal and hands it to the engine (core.engine_api), with its
stream (core.output.decode_streams) as the callbacks' target. Without KV the engine prefills
the prompt itself; KV it cannot pull is recomputed from the ids, never re-rendered; KV of a
request that ends before its pull is discarded at once (KVHandover). Every call into the
server (responses, cancellation checks, metrics) runs on the outbox thread
(pdchat.triton.outbox), in order, while the engine runs its next pass. A request with only
`cancel_request_id` (sealed by chat) stops the named request; one with `decode_feed_open`
(and chat's grant) opens a feed (core.output.feeds).
"""

import functools
import logging
import os
import time

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.engine_api import DECODE, DecodeRequest, EngineHooks
from pdchat.core.engines import open_engine
from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.sampling import Choice
from pdchat.core.kv.base import engine_transfer_params
from pdchat.core.kv.connector import Connectors, KVHandover
from pdchat.core.output.decode_streams import DecodeStreams
from pdchat.core.output.feeds import DecodeFeeds
from pdchat.core.settings import batching_options, cores_in_turns, keep_off_decode_cpus, kv_options
from pdchat.ensemble.core_turns import PassTurns
from pdchat.ensemble.decode_load import LoadSlot
from pdchat.ensemble.seal import StageSeal, server_directory
from pdchat.models import resolve_model
from pdchat.registry import ENGINE_KV
from pdchat.triton import io
from pdchat.triton.kv_events import KVEvents
from pdchat.triton.metrics import DecodeServerMetrics
from pdchat.triton.outbox import Outbox
from pdchat.triton.server_watch import exit_with_server, leave_soon

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("pdchat.decode")


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        cpus = keep_off_decode_cpus(parameters)  # the scheduler thread takes cpus.decode
        kind, device_id = io.instance_placement(args)
        if kind == "GPU" and device_id > 0:
            log.warning("an instance per GPU: chat's cancellations reach one instance; run a server per GPU")
        settings = resolve_model(parameters).on_instance(kind, device_id)
        instance = args["model_instance_name"]
        self.engine = open_engine(DECODE, settings, parameters, instance, cpus)
        pb_utils.Logger.log_info(f"{instance}: {self.engine.path.describe()}")
        self.metrics = DecodeServerMetrics(
            args["model_name"], instance, settings.served_name, self.engine.path, self.engine.context_length
        )
        self.seal = StageSeal.for_this_server()
        self.connectors = Connectors(**kv_options(parameters))
        self.kv_events = KVEvents("decode", parameters, args, self.engine.kv_pool)  # off unless its endpoint is set
        # About one step's responses may wait for the outbox before the engine waits too.
        self.outbox = Outbox("pdchat-decode-outbox", max_pending=2 * batching_options(parameters).max_running)
        transport = io.StreamTransport()
        self.feeds = DecodeFeeds(transport, on_closed=self.outbox.unwatch)  # on the outbox thread
        # What chat reads to let an idle decode prefill a prompt itself (setting local_prefill_when_idle).
        self.load = LoadSlot(server_directory(os.getppid()), instance, self.engine.kv_capacity_tokens)
        self.streams = DecodeStreams(transport, self.metrics, self.feeds, self.engine.cancel, self.outbox.unwatch)
        flush = functools.partial(self.outbox.call, self.feeds.flush)
        # With prefill_takes_cores_ms, each step waits for a prompt pass a prefill on these cores
        # marks (ensemble.core_turns); not with decode_cpus: the scheduler has a CPU of its own.
        self.turns = None
        if cores_in_turns(parameters) and cpus is None:
            self.turns = PassTurns(server_directory(os.getppid()))
        self.engine.start(
            EngineHooks(
                on_state=self._on_state,
                on_load=self.load.set,
                on_emitted=flush,
                on_dead=leave_soon,
                before_step=self.turns and self.turns.wait,
            )
        )

    def execute(self, requests):
        # NOTE: execute() hands the outbox its calls with post(), which never waits.
        for request in requests:
            sender = request.get_response_sender()
            try:
                feed = io.feed_opened(request)
                if feed is not None:
                    self.seal.check_feed(feed, io.input_text(request, tensors.STAGE_SEAL))
                    self.outbox.post(functools.partial(self._open_feed, feed, sender))
                    continue
                cancel = io.input_text(request, tensors.CANCEL_REQUEST_ID)
                if cancel is not None:
                    self.seal.check_cancel(cancel, io.input_text(request, tensors.STAGE_SEAL))
                    self.engine.cancel(cancel)
                    self.outbox.post(functools.partial(sender.send, flags=FINAL))
                    continue
                self._decode(request, sender)
            except Exception as exc:  # noqa: BLE001
                self.outbox.post(functools.partial(sender.send, io.error_response(exc), flags=FINAL))
        return None

    def finalize(self):
        self.engine.close()
        self.load.close()
        if self.turns is not None:
            self.turns.close()
        self.kv_events.close()
        self.outbox.call(self.feeds.close_all)
        self.outbox.close()
        self.connectors.close()
        self.metrics.close()

    def _decode(self, request, sender) -> None:
        """Hand the request to the engine, with its stream's callbacks."""
        engine = self.engine
        stage = io.stage_input(request, self.seal, engine.context_length, engine.vocab_size)
        # Prefill's KV and first token come only inside a sealed handle; without one decode prefills.
        # KV an engine moves itself (ENGINE_KV) is the engine's to pull, through the handle's transfer params.
        handle = stage.kv_handle
        kv = None if handle is None or handle.connector == ENGINE_KV else KVHandover(self.connectors, handle)
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
        assembler = engine.assembler(ids, params, first_output_sent=first_sent)
        stream = io.decode_stream(request, sender, params.request_id, assembler, given_first=first is not None, kv=kv)
        self.outbox.post(functools.partial(self.metrics.arrived, stream.key, time.monotonic(), len(ids)))
        self.outbox.watch(stream, sender.is_cancelled, functools.partial(self.engine.cancel, stream.key))
        source = {} if kv is None else kv.decode_source(stream.key, functools.partial(self._post, self.metrics.kv_pull))
        if handle is not None and handle.connector == ENGINE_KV:
            source = {"transfer_params": engine_transfer_params(handle)}
        cached = 0 if handle is None else handle.cached_tokens
        owner = io.kv_owner(request)
        request = DecodeRequest(stream.key, ids, params, first=first, cached_tokens=cached, owner=owner, **source)
        engine.decode(request, self.streams.callbacks(stream, self._post))

    def _post(self, function, *args) -> None:
        """From the engine's thread: `function(*args)` on the outbox thread, in order."""
        self.outbox.call(functools.partial(function, *args))

    def _on_state(self, state) -> None:
        self.outbox.call(functools.partial(self.metrics.state, state, self.engine.pool_usage()))

    # On the outbox thread:

    def _open_feed(self, feed: str, sender) -> None:
        if self.feeds.open(feed, sender):
            self.outbox.watch(feed, sender.is_cancelled, functools.partial(self.feeds.close, feed))
