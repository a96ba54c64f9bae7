"""chat (BLS, decoupled): the client-facing router.

Decides once per request, before any rendering (pdchat.ensemble.routing): forwarded
ids admitted by the gate go straight to decode, skipping the renderer; other requests
run renderer -> prefill -> decode; `do_remote_decode` requests stop after prefill and
answer with signed kv_transfer_params.

Each request is a coroutine on the model's one event loop (pdchat.triton.event_loop):
every call that talks to the server process (response sends, cancellation checks,
decoupled BLS set-up, logs, metrics) happens on that thread; blocking BLS calls to
renderer and prefill run one at a time on one worker thread. (Two threads making blocking
BLS calls at once corrupted the stub's heap at concurrency 16: keep it one.) Many threads calling into
the python backend at once is what crashed the server under load.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.handoff import ForwardedIdsRejected, Gate, load_key, parse_policy
from pdchat.core.protocol import GenerationParams
from pdchat.core.render_cost import RenderRate
from pdchat.core.rendering import ChatRenderer
from pdchat.core.responses import remote_prefill_output
from pdchat.core.settings import forwarded_ids_policy, handoff_ttl_s, kv_connector, resolve_model
from pdchat.ensemble.routing import ChatRouter, Route
from pdchat.triton import io
from pdchat.triton.event_loop import ModelEventLoop
from pdchat.triton.metrics import HandoffMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
RENDERER, PREFILL, DECODE = "renderer", "prefill", "decode"
STAGES = "stages"  # the one lane for blocking BLS calls
# Requests served at once; more wait (as coroutines, holding nothing) for a slot.
MAX_CONCURRENT_REQUESTS = 64
# How often a stream asks whether its client left (each ask is a round trip to the server).
CANCEL_POLL_S = 0.05


class TritonPythonModel:
    def initialize(self, args):
        parameters = io.model_parameters(args)
        settings = resolve_model(parameters)
        # The tokenizer here only calibrates the render rate and spells prefill's first token.
        self.renderer = ChatRenderer(settings.path, settings.served_name)
        gate = Gate(
            policy=parse_policy(forwarded_ids_policy(parameters)),
            key=load_key(),
            vocab_size=len(self.renderer.tokenizer),
            context_length=self.renderer.context_length,
        )
        self.router = ChatRouter(gate, settings.served_name, handoff_ttl_s(parameters))
        self.kv_connector = kv_connector(parameters)
        self.render_rate = RenderRate.calibrate(lambda messages: self.renderer.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False))
        self.metrics = HandoffMetrics(args["model_name"])
        self.loop = ModelEventLoop("pdchat-chat", MAX_CONCURRENT_REQUESTS)

    def execute(self, requests):
        for request in requests:
            self.loop.submit(self._serve(request, request.get_response_sender()))
        return None

    def finalize(self):
        self.loop.close()
        self.metrics.close()

    async def _serve(self, request, sender):
        try:
            await self._route(request, sender)
        except ForwardedIdsRejected as exc:
            self.metrics.rejected(exc.reason.value)
            sender.send(io.error_response(exc), flags=FINAL)
        except StageError as exc:
            sender.send(pb_utils.InferenceResponse(error=exc.error), flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its client
            sender.send(io.error_response(exc), flags=FINAL)

    async def _route(self, request, sender):
        chat = io.chat_request(request)
        plan = self.router.plan(
            chat,
            io.input_token_ids(request, tensors.PROMPT_TOKEN_IDS),
            io.input_text(request, tensors.KV_TRANSFER_PARAMS),
        )
        pb_utils.Logger.log_info(f"chat request {request.request_id() or '-'}: route {plan.route.value}")
        if plan.route is Route.REUSE:
            self.metrics.accepted(self.render_rate.estimate(len(plan.prompt_token_ids)))
            handle = plan.kv_handle
            kv = [] if handle is None else [io.string_tensor(tensors.KV_HANDLE, json.dumps(handle)),
                                            io.int32_tensor(tensors.FIRST_TOKEN_ID, [handle["first_token_id"]])]
            await self._stream_decode(request, sender, plan.prompt_token_ids, plan.params, kv)
            return
        ids, params = await self.loop.call_blocking(STAGES, self._render, request)
        if plan.route is Route.REMOTE_PREFILL:
            first, handle = await self.loop.call_blocking(STAGES, self._prefill, request, ids, params, self.kv_connector)
            handoff = self.router.handoff_params(chat, ids, kv_handle=handle)
            output = remote_prefill_output(params, ids, first, self.renderer.tokenizer.decode([first], skip_special_tokens=True))
            sender.send(pb_utils.InferenceResponse(output_tensors=io.client_tensors(output) + [
                io.string_tensor(tensors.KV_TRANSFER_PARAMS, json.dumps(handoff))]), flags=FINAL)
            return
        first, kv_cache = await self.loop.call_blocking(STAGES, self._prefill, request, ids, params)
        await self._stream_decode(request, sender, ids, params, [kv_cache, io.int32_tensor(tensors.FIRST_TOKEN_ID, [first])])

    def _render(self, request):
        inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in tensors.CLIENT_INPUTS) if t is not None]
        started = time.perf_counter()
        response = _exec(request, RENDERER, inputs, [tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS])
        ids = pb_utils.get_output_tensor_by_name(response, tensors.PROMPT_TOKEN_IDS).as_numpy()
        self.render_rate.observe(time.perf_counter() - started, len(ids))
        params = pb_utils.get_output_tensor_by_name(response, tensors.GENERATION_PARAMS).as_numpy()[0]
        return ids.astype(np.int32).tolist(), GenerationParams.from_json(params.decode())

    def _prefill(self, request, ids, params, destination=None):
        """(first token, KV tensor), or with a destination connector (first token, KV handle)."""
        inputs = [io.int32_tensor(tensors.PROMPT_TOKEN_IDS, ids), io.string_tensor(tensors.GENERATION_PARAMS, params.to_json())]
        if destination is None:
            response = _exec(request, PREFILL, inputs, [tensors.FIRST_TOKEN_ID, tensors.KV_CACHE])
            kv = pb_utils.get_output_tensor_by_name(response, tensors.KV_CACHE)
        else:
            inputs.append(io.string_tensor(tensors.KV_DESTINATION, destination))
            response = _exec(request, PREFILL, inputs, [tensors.FIRST_TOKEN_ID, tensors.KV_HANDLE])
            kv = json.loads(pb_utils.get_output_tensor_by_name(response, tensors.KV_HANDLE).as_numpy()[0])
        first = int(pb_utils.get_output_tensor_by_name(response, tensors.FIRST_TOKEN_ID).as_numpy()[0])
        return first, kv

    async def _stream_decode(self, request, sender, ids, params, kv_inputs):
        """Forward decode's stream; `kv_inputs`: prefill's first token with its KV tensor or handle."""
        inputs = [io.int32_tensor(tensors.PROMPT_TOKEN_IDS, ids), io.string_tensor(tensors.GENERATION_PARAMS, params.to_json())]
        inputs += kv_inputs
        responses = pb_utils.InferenceRequest(
            model_name=DECODE, inputs=inputs, requested_output_names=list(tensors.CLIENT_OUTPUTS), request_id=request.request_id()
        ).exec(decoupled=True)
        finished = cancelled = False
        polled_at = float("-inf")
        async for response in self.loop.iterate(responses):
            if not cancelled and time.monotonic() - polled_at >= CANCEL_POLL_S:
                polled_at = time.monotonic()
                if sender.is_cancelled():
                    # 2.51 passes no cancellation down a BLS call: tell decode ourselves, then drain.
                    cancelled = True
                    await self._cancel_decode(params.request_id)
            if cancelled:
                continue
            if response.has_error():
                sender.send(pb_utils.InferenceResponse(error=StageError(response.error()).error), flags=FINAL)
                return
            if not response.output_tensors():
                continue
            finish = pb_utils.get_output_tensor_by_name(response, tensors.FINISH_REASON).as_numpy()[0]
            finished = bool(finish)
            sender.send(pb_utils.InferenceResponse(output_tensors=response.output_tensors()), flags=FINAL if finished else 0)
        if not finished:
            sender.send(flags=FINAL)

    async def _cancel_decode(self, request_id):
        """A decoupled control request that answers with a bare final response."""
        responses = pb_utils.InferenceRequest(
            model_name=DECODE, inputs=[io.string_tensor(tensors.CANCEL_REQUEST_ID, request_id)], requested_output_names=[]
        ).exec(decoupled=True)
        async for _ in self.loop.iterate(responses):
            pass


class StageError(Exception):
    """A stage model answered with an error; it goes to the client with its code."""

    def __init__(self, error):
        super().__init__(error.message())
        code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL
        self.error = pb_utils.TritonError(error.message(), code)


def _exec(request, model_name, inputs, outputs):
    response = pb_utils.InferenceRequest(
        model_name=model_name, inputs=inputs, requested_output_names=outputs, request_id=request.request_id()
    ).exec()
    if response.has_error():
        raise StageError(response.error())
    return response
