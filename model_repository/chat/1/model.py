"""chat (BLS, decoupled): the client-facing model, in front of the stage models.

Parses the request once, then decides, before any rendering (pdchat.ensemble.routing): forwarded
ids admitted by the gate go straight to decode, skipping the renderer; other requests
run renderer -> prefill -> decode; `do_remote_decode` requests stop after prefill and
answer with signed kv_transfer_params. What it hands the stages is sealed
(pdchat.ensemble.seal): the renderer gets the parsed request, decode the admitted ids.
Its inputs and outputs come from tensors.py (auto-complete), one contract for every role.

Each request is a coroutine on the model's one event loop (pdchat.triton.event_loop):
every call that talks to the server process (response sends, cancellation checks,
decoupled BLS set-up, logs, metrics) happens on that thread; blocking BLS calls to
renderer and prefill run on worker threads (lanes, `stage_lanes`), one per prefill instance.
Many threads calling into the python backend at once is what crashed the server under
load (a metric bumped from many threads; README, "Concurrency in the python backend").
"""

import time

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.kv.base import KVHandle
from pdchat.core.output.logprobs import TokenSpeller
from pdchat.core.output.responses import FAILED, Delta, remote_prefill_output
from pdchat.core.request.protocol import ChatRequest, GenerationParams
from pdchat.core.request.render_cost import RenderRate
from pdchat.core.request.renderers import load_renderer
from pdchat.core.settings import forwarded_ids_policy, handoff_ttl_s, kv_connector, max_request_bytes, stage_lanes
from pdchat.ensemble.gate import ForwardedIdsRejected, Gate, parse_policy
from pdchat.ensemble.handoff import load_key
from pdchat.ensemble.routing import Route, RoutePlanner
from pdchat.ensemble.seal import StageSeal
from pdchat.models import resolve_model
from pdchat.registry import SHM
from pdchat.triton import io
from pdchat.triton.event_loop import ModelEventLoop
from pdchat.triton.metrics import HandoffMetrics, ParseMetrics
from pdchat.triton.server_watch import exit_with_server

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
RENDERER, PREFILL, DECODE = "renderer", "prefill", "decode"
STAGES = "stages"  # the pool of lanes for blocking BLS calls to renderer and prefill (settings.stage_lanes)
# Requests served at once; more wait (as coroutines, holding nothing) for a slot.
MAX_CONCURRENT_REQUESTS = 64
# How often a stream asks whether its client left (each ask is a round trip to the server).
CANCEL_POLL_S = 0.05


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(0)
        config.set_model_transaction_policy({"decoupled": True})
        return io.declare_contract(config, tensors.CHAT_INPUTS, tensors.CHAT_OUTPUTS)

    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        settings = resolve_model(parameters)
        # The tokenizer here only calibrates the render rate and spells prefill's first token.
        self.renderer = load_renderer(settings.path, settings.served_name, parameters)
        self.speller = TokenSpeller(self.renderer.tokenizer)
        gate = Gate(
            policy=parse_policy(forwarded_ids_policy(parameters)),
            key=load_key(),
            vocab_size=len(self.renderer.tokenizer),
            context_length=self.renderer.context_length,
        )
        self.planner = RoutePlanner(gate, settings.served_name, handoff_ttl_s(parameters), self.renderer.render_defaults)
        self.kv_connector = kv_connector(parameters)
        self.max_request_bytes = max_request_bytes(parameters)
        self.stage_lanes = stage_lanes(parameters)
        self.seal = StageSeal.for_this_server()
        self.render_rate = RenderRate.calibrate(lambda messages: self.renderer.token_ids(ChatRequest(messages=messages)))
        self.metrics = HandoffMetrics(args["model_name"])
        self.parses = ParseMetrics(args["model_name"])
        self.loop = ModelEventLoop("pdchat-chat", MAX_CONCURRENT_REQUESTS)

    def execute(self, requests):
        for request in requests:
            self.loop.submit(self._serve(request, request.get_response_sender()))
        return None

    def finalize(self):
        self.loop.close()
        self.metrics.close()
        self.parses.close()

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
        chat, form = io.chat_request(request, self.max_request_bytes)
        self.parses.parsed(form)
        plan = self.planner.plan(  # kv_transfer_params: the tensor, or inside the JSON (vLLM)
            chat,
            io.input_token_ids(request, tensors.PROMPT_TOKEN_IDS),
            io.input_text(request, tensors.KV_TRANSFER_PARAMS),
        )
        pb_utils.Logger.log_info(f"chat request {request.request_id() or '-'}: route {plan.route.value}")
        if plan.route is Route.REUSE:
            self.metrics.accepted(self.render_rate.estimate(len(plan.prompt_token_ids)))
            params = plan.generation.to_json()
            handle = "" if plan.kv_handle is None else plan.kv_handle.to_json()
            seal = self.seal.seal_prompt(plan.prompt_token_ids, params, handle)
            await self._stream_decode(request, sender, plan.generation, io.stage_inputs(plan.prompt_token_ids, params, seal, handle))
            return
        self.renderer.check_size(chat)  # before the text crosses to the renderer
        canonical = chat.to_json()
        ids, params_text, seal = await self.loop.call_pooled(STAGES, self.stage_lanes, self._render, request, canonical)
        params = GenerationParams.from_json(params_text)
        if plan.route is Route.RENDER_VERIFIED:  # the benchmarks' baseline: decode rendered, then uses the KV
            handle = self.planner.admit_rendered(plan, ids)
            handle_text = "" if handle is None else handle.to_json()
            inputs = io.stage_inputs(ids, params_text, self.seal.seal_prompt(ids, params_text, handle_text), handle_text)
            await self._stream_decode(request, sender, params, inputs)
            return
        if plan.route is Route.REMOTE_PREFILL:
            handle_text, _ = await self.loop.call_pooled(STAGES, self.stage_lanes, self._prefill, request, ids, params_text, seal, self.kv_connector)
            handle = KVHandle.from_json(handle_text)  # signed into the handoff, with its first token shown
            handoff = self.planner.sign_handoff(chat, ids, kv_handle=handle)
            output = remote_prefill_output(params, ids.tolist(), self._first_delta(handle), self.speller, handoff.to_params())
            io.send_tensors(sender, io.client_tensors(output) + [io.string_tensor(tensors.KV_TRANSFER_PARAMS, handoff.to_json())],
                            flags=FINAL)
            return
        handle_text, decode_seal = await self.loop.call_pooled(STAGES, self.stage_lanes, self._prefill, request, ids, params_text, seal, SHM)
        await self._stream_decode(request, sender, params, io.stage_inputs(ids, params_text, decode_seal, handle_text))

    def _render(self, request, canonical):
        """The renderer's (ids, generation params JSON, seal) for the request chat parsed."""
        inputs = [io.string_tensor(tensors.CHAT_REQUEST, canonical), io.string_tensor(tensors.STAGE_SEAL, self.seal.seal_request(canonical))]
        started = time.perf_counter()
        response = _exec(request, RENDERER, inputs, [tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS, tensors.STAGE_SEAL])
        # A copy: as_numpy() maps the response's shared memory, which is freed with the response
        # (a view kept past it and handed to prefill and decode corrupted the stub's heap).
        ids = pb_utils.get_output_tensor_by_name(response, tensors.PROMPT_TOKEN_IDS).as_numpy().copy()
        self.render_rate.observe(time.perf_counter() - started, len(ids))
        params, seal = (pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0].decode()
                        for name in (tensors.GENERATION_PARAMS, tensors.STAGE_SEAL))
        return ids, params, seal  # INT32 as the renderer answered: no list on the way to prefill and decode

    def _prefill(self, request, ids, params, seal, destination):
        """Prefill with the KV published through `destination` (shm for this server's decode,
        the configured connector for another's): its handle's JSON (first token inside), as
        prefill sealed it, and that seal, which opens decode with it."""
        inputs = io.stage_inputs(ids, params, seal) + [io.string_tensor(tensors.KV_DESTINATION, destination)]
        response = _exec(request, PREFILL, inputs, [tensors.KV_HANDLE, tensors.STAGE_SEAL])
        handle, decode_seal = (pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0].decode()
                               for name in (tensors.KV_HANDLE, tensors.STAGE_SEAL))
        return handle, decode_seal

    def _first_delta(self, handle):
        """Prefill's first token as the prefill leg's answer shows it."""
        token, logprobs = handle.first_token_id, handle.first_token_logprobs
        text = self.renderer.tokenizer.decode([token], skip_special_tokens=True)
        return Delta(text, [token], None, [] if logprobs is None else [logprobs])

    async def _stream_decode(self, request, sender, params, inputs):
        """Forward decode's stream; `inputs`: the sealed stage inputs, with prefill's KV if any."""
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
            if finish == FAILED.encode():  # decode failed mid-stream: a Triton error for our client
                sender.send(io.failure_as_error(response), flags=FINAL)
                return
            finished = bool(finish)
            io.send_tensors(sender, response.output_tensors(), flags=FINAL if finished else 0)
        if not finished:
            sender.send(flags=FINAL)

    async def _cancel_decode(self, request_id):
        """A decoupled control request that answers with a bare final response."""
        inputs = [io.string_tensor(tensors.CANCEL_REQUEST_ID, request_id), io.string_tensor(tensors.STAGE_SEAL, self.seal.seal_cancel(request_id))]
        responses = pb_utils.InferenceRequest(model_name=DECODE, inputs=inputs, requested_output_names=[]).exec(decoupled=True)
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
