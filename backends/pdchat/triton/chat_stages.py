"""`chat`'s stages over BLS: the Triton executor of `pdchat.ensemble.flow.ChatFlow`.

One `BLSStages` per request. Blocking BLS calls (renderer, prefill) run on the model event
loop's lanes; decode's decoupled stream is opened and read on a thread of its own; the other
calls into the server (sends, cancellation checks, logs) happen on the loop thread
(`pdchat.triton.event_loop`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.errors import ErrorCode, InvalidRequest, PdchatError, Unavailable, parse_tag
from pdchat.core.output.responses import FAILED, ClientOutput
from pdchat.ensemble.flow import DecodeCall, Prefilled, Rendered
from pdchat.ensemble.routing import Route
from pdchat.tensors import DECODE, PREFILL, RENDERER
from pdchat.triton import io
from pdchat.triton.event_loop import ModelEventLoop

STAGES = "stages"  # the pool of lanes for blocking BLS calls to renderer and prefill (settings.stage_lanes)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class StageError(PdchatError):
    """A stage model answered with an error: the client gets `error` as the stage sent it
    (Triton code and message untouched); `code` is what the message's tag says."""

    def __init__(self, error: pb_utils.TritonError):
        super().__init__(error.message())
        self.code = parse_tag(error.message())[0] or ErrorCode.INTERNAL
        triton_code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL
        self.error = pb_utils.TritonError(error.message(), triton_code)


class BLSStages:
    """The stage models of this server, reached by BLS on behalf of one client request."""

    def __init__(self, request: Any, sender: Any, loop: ModelEventLoop, lanes: int):
        self.request = request
        self.sender = sender
        self.loop = loop
        self.lanes = lanes
        self.heartbeat_s = io.heartbeat_s(request)  # the client's, if it asked for heartbeats
        self.ticketed = io.ticket_requested(request)
        self.feed_grant = io.feed_grant_requested(request)
        if self.feed_grant is not None and not self.ticketed:
            raise InvalidRequest(f"request parameter '{tensors.DECODE_FEED_GRANT}' needs '{tensors.DECODE_TICKET}'")
        self.first_output_early = io.bool_parameter(request, tensors.FIRST_OUTPUT_EARLY)
        self.first_output_sent = io.bool_parameter(request, tensors.FIRST_OUTPUT_SENT)
        self.kv_owner = io.kv_owner(request)  # passed on to decode

    def routed(self, route: Route) -> None:
        pb_utils.Logger.log_info(f"chat request {self.request.request_id() or '-'}: route {route.value}")

    async def render(self, request_json: str, seal: str) -> Rendered:
        return await self.loop.call_pooled(STAGES, self.lanes, self._render, request_json, seal)

    async def prefill(self, rendered: Rendered, destination: str, first_output: bool) -> Prefilled:
        return await self.loop.call_pooled(STAGES, self.lanes, self._prefill, rendered, destination, first_output)

    def send(self, output: ClientOutput) -> None:
        io.send_tensors(self.sender, io.client_tensors(output, io.requested_client_outputs(self.request)))

    async def decode(self, call: DecodeCall) -> AsyncIterator[Any]:
        inputs = self._decode_inputs(call)
        beats = [beat for beat in (call.heartbeat_s, self.heartbeat_s) if beat is not None]
        parameters: dict[str, Any] = {tensors.HEARTBEAT_MS: max(1, round(1000 * min(beats)))} if beats else {}
        if self.kv_owner:
            parameters[tensors.KV_OWNER] = self.kv_owner
        request = pb_utils.InferenceRequest(
            model_name=DECODE,
            inputs=inputs,
            parameters=parameters,
            request_id=self.request.request_id(),
            # What our client asked for, and what the relay reads.
            requested_output_names=sorted(
                io.requested_client_outputs(self.request) | {tensors.RESPONSE, tensors.FINISH_REASON}
            ),
        )
        async for response in self.loop.iterate(functools.partial(request.exec, decoupled=True)):
            yield response

    def relay(self, response: Any) -> bool:
        if response.has_error():
            self.sender.send(pb_utils.InferenceResponse(error=StageError(response.error()).error), flags=FINAL)
            return True
        if not response.output_tensors():  # a heartbeat, or the end of decode's stream
            if self.heartbeat_s is not None:  # the client waits for its whole answer within a deadline too
                self.sender.send(io.heartbeat())
            return False
        finish = pb_utils.get_output_tensor_by_name(response, tensors.FINISH_REASON).as_numpy()[0]
        if finish == FAILED.encode():  # decode failed mid-stream: a Triton error for our client
            self.sender.send(io.failure_as_error(response), flags=FINAL)
            return True
        io.send_tensors(self.sender, response.output_tensors(), flags=FINAL if finish else 0)
        return bool(finish)

    def refused(self, response: Any) -> bool:
        if response.has_error():
            return True
        finish = pb_utils.get_output_tensor_by_name(response, tensors.FINISH_REASON)
        return finish is not None and finish.as_numpy()[0] == FAILED.encode()

    def answer(self, output: ClientOutput, kv_transfer_params: str) -> None:
        kv_tensor = io.string_tensor(tensors.KV_TRANSFER_PARAMS, kv_transfer_params)
        io.send_tensors(self.sender, io.client_tensors(output) + [kv_tensor], flags=FINAL)

    def wants_ticket(self) -> bool:
        return self.ticketed

    def wants_first_output(self) -> bool:
        return self.first_output_early

    def has_first_output(self) -> bool:
        return self.first_output_sent

    def feed_to_grant(self) -> str | None:
        return self.feed_grant

    def ticket(self, call: DecodeCall, feed_seal: str | None) -> None:
        grant = [] if feed_seal is None else [io.string_tensor(tensors.FEED_SEAL, feed_seal)]
        io.send_tensors(self.sender, self._decode_inputs(call) + grant, flags=FINAL)

    def close(self) -> None:
        self.sender.send(flags=FINAL)

    def client_left(self) -> bool:
        return self.sender.is_cancelled()

    async def cancel(self, request_id: str, seal: str) -> None:
        """A decoupled control request to decode; it answers with a bare final response.

        NOTE: Triton 2.51 passes no cancellation down a BLS call, hence this request."""
        inputs = [io.string_tensor(tensors.CANCEL_REQUEST_ID, request_id), io.string_tensor(tensors.STAGE_SEAL, seal)]
        request = pb_utils.InferenceRequest(model_name=DECODE, inputs=inputs, requested_output_names=[])
        async for _ in self.loop.iterate(functools.partial(request.exec, decoupled=True)):
            pass

    # On a lane's worker thread:

    def _render(self, request_json: str, seal: str) -> Rendered:
        inputs = [io.string_tensor(tensors.CHAT_REQUEST, request_json), io.string_tensor(tensors.STAGE_SEAL, seal)]
        started = time.perf_counter()
        response = self._exec(
            RENDERER, inputs, [tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS, tensors.STAGE_SEAL]
        )
        render_s = time.perf_counter() - started
        # NOTE: a copy. as_numpy() maps the response's shared memory, which is freed with the
        # response; prefill and decode get these ids after it is gone.
        ids = pb_utils.get_output_tensor_by_name(response, tensors.PROMPT_TOKEN_IDS).as_numpy().copy()
        params, prompt_seal = (_text_output(response, name) for name in (tensors.GENERATION_PARAMS, tensors.STAGE_SEAL))
        return Rendered(ids, params, prompt_seal, render_s)

    def _prefill(self, rendered: Rendered, destination: str, first_output: bool) -> Prefilled:
        inputs = io.stage_inputs(rendered.prompt_token_ids, rendered.params_text, rendered.seal)
        inputs.append(io.string_tensor(tensors.KV_DESTINATION, destination))
        outputs = [tensors.KV_HANDLE, tensors.STAGE_SEAL] + ([tensors.FIRST_OUTPUT] if first_output else [])
        response = self._exec(PREFILL, inputs, outputs)
        shown = _text_output(response, tensors.FIRST_OUTPUT) if first_output else ""
        return Prefilled(
            _text_output(response, tensors.KV_HANDLE),
            _text_output(response, tensors.STAGE_SEAL),
            ClientOutput.from_json(shown) if shown else None,
        )

    @staticmethod
    def _decode_inputs(call: DecodeCall) -> list:
        return io.stage_inputs(
            call.prompt_token_ids, call.params_text, call.seal, call.kv_handle, call.first_output_sent
        )

    def _exec(self, model_name: str, inputs: list, outputs: list[str]) -> Any:
        response = pb_utils.InferenceRequest(
            model_name=model_name, inputs=inputs, requested_output_names=outputs, request_id=self.request.request_id()
        ).exec()
        if response.has_error():
            message = response.error().message()
            if f"Model '{model_name}' is not ready" in message or "unknown model" in message:
                raise Unavailable(
                    f"this server does not serve the {model_name} stage: model '{model_name}' is not loaded "
                    "(with setting engine vllm a server loads the engine of its role alone: docs/engines.md)"
                )
            raise StageError(response.error())
        return response


def _text_output(response: Any, name: str) -> str:
    return pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0].decode()
