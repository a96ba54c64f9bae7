"""decode (decoupled): sealed prompt ids + prefill's KV and first token -> streamed answer.

Without KV it prefills locally, in chunks between decode steps; a KV handle it cannot
pull (expired, prefill gone) is recomputed from the ids, never re-rendered. All running
requests advance in one forward pass per step (continuous batching, core.scheduler);
execute() only validates and queues, and every response, errors included, is sent from
the scheduler thread (one thread calling into the python backend; see the chat model).
A request carrying only `cancel_request_id` (sealed by chat) stops the named request instead.
"""

import functools
import logging

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.engine import DecodeBatch
from pdchat.core.generation.generation import TextModel
from pdchat.core.generation.sampling import Choice
from pdchat.core.generation.scheduler import DecodeJob, DecodeScheduler, Limits
from pdchat.core.kv.connector import Connectors, KVUnavailable
from pdchat.core.settings import batching_options, kv_options
from pdchat.ensemble.seal import StageSeal
from pdchat.models import resolve_model
from pdchat.triton import io
from pdchat.triton.metrics import DecodeMetrics
from pdchat.triton.server_watch import exit_with_server

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("pdchat.decode")


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        settings = resolve_model(parameters)
        self.model = TextModel(settings.path, settings.device, settings.dtype, settings.threads)
        self.seal = StageSeal.for_this_server()
        self.connectors = Connectors(**kv_options(parameters))
        self.metrics = DecodeMetrics(args["model_name"])
        self.options = batching_options(parameters)
        limits = Limits(max_running=self.options.max_running, kv_budget_bytes=self.options.kv_budget_bytes,
                        kv_bytes_per_token=self.model.engine.kv_bytes_per_token(), max_wait_s=self.options.queue_timeout_s)
        self.scheduler = DecodeScheduler(DecodeBatch(self.model.engine), limits,
                                         on_state=lambda state: self.metrics.scheduler(state.waiting, state.kv_bytes))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                cancel = io.input_text(request, tensors.CANCEL_REQUEST_ID)
                if cancel is not None:
                    self.seal.check_cancel(cancel, io.input_text(request, tensors.STAGE_SEAL))
                    self.scheduler.cancel(cancel)
                    self.scheduler.post(functools.partial(sender.send, flags=FINAL))
                    continue
                job = self._job(request, sender)
            except Exception as exc:  # noqa: BLE001
                self.scheduler.post(functools.partial(sender.send, io.error_response(exc), flags=FINAL))
                continue
            self.scheduler.submit(job)
        return None

    def finalize(self):
        self.scheduler.close()
        self.connectors.close()
        self.metrics.close()

    def _job(self, request, sender) -> DecodeJob:
        engine = self.model.engine
        stage = io.stage_input(request, self.seal, engine.context_length, engine.vocab_size)
        ids, params, handle = stage.prompt_token_ids, stage.params, stage.kv_handle
        # Prefill's KV and first token come only inside a sealed handle; without one decode prefills.
        first = None if handle is None else Choice(handle.first_token_id, handle.first_token_logprobs)
        if first is not None and not 0 <= first.token_id < engine.vocab_size:
            raise InvalidRequest(f"the KV handle's first token {first.token_id} is not in this model's vocabulary")
        assembler = self.model.assembler(ids, params)
        started = False  # admitted: counted in pdchat_decode_active until it ends

        def start():
            nonlocal started
            started = True
            self.metrics.started()
            kv_cache = None if handle is None else self._pull(handle, params.request_id)
            released = None if handle is None or kv_cache is None else (lambda: self.connectors.done(handle))
            return self.model.generation(ids, params, first=first, kv_cache=kv_cache, on_kv_released=released,
                                         prefill_chunk=self.options.prefill_chunk)

        def emit(delta):
            for output in assembler.on_delta(delta):
                sender.send(io.client_response(output), flags=FINAL if output.final else 0)
            if delta.finish_reason:
                self.metrics.ended("finished", started)

        def fail(exc):
            sender.send(io.failed_response(exc), flags=FINAL)
            self.metrics.ended("failed", started)

        def on_cancel():
            sender.send(flags=FINAL)
            self.metrics.ended("cancelled", started)

        return DecodeJob(
            key=params.request_id,
            start=start,
            emit=emit,
            fail=fail,
            is_cancelled=sender.is_cancelled,
            on_cancel=on_cancel,
            tokens=len(ids) + params.max_tokens,
        )

    def _pull(self, handle, request_id):
        """The KV a handle names, or None (decode then recomputes it from the ids)."""
        try:
            kv = self.connectors.pull(handle)
        except KVUnavailable as exc:
            log.warning("request %s: KV pull failed, recomputing prefill from the forwarded ids: %s", request_id, exc)
            self.metrics.kv_pull("recomputed")
            return None
        self.metrics.kv_pull("pulled")
        return kv
