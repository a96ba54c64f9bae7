"""Triton tensors <-> typed core values, and core errors -> Triton error codes.

Only the model.py adapters import this module: it needs the python backend's
`triton_python_backend_utils`, which exists inside the backend stub alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core import settings
from pdchat.core.errors import ErrorCode, InvalidRequest, error_code, parse_tag, tagged_message
from pdchat.core.kv.base import KVHandle
from pdchat.core.output.decode_streams import DecodeStream
from pdchat.core.output.responses import FAILED, ClientOutput
from pdchat.core.request.protocol import (
    ChatRequest,
    GenerationParams,
    parse_chat_json,
    parse_completion_json,
    text_input_request,
)
from pdchat.ensemble.seal import StageSeal


def declare_contract(config, inputs: tuple[tensors.TensorSpec, ...], outputs: tuple[tensors.TensorSpec, ...]):
    """auto_complete_config: a model's inputs and outputs from tensors.py, so the configs
    that serve it in several roles need not repeat them."""
    for spec in inputs:
        config.add_input(
            {"name": spec.name, "data_type": spec.data_type, "dims": list(spec.dims), "optional": spec.optional}
        )
    for spec in outputs:
        config.add_output({"name": spec.name, "data_type": spec.data_type, "dims": list(spec.dims)})
    return config


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt as a plain dict."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def instance_placement(args: dict) -> tuple[str, int]:
    """This instance's kind as Triton resolved it ("CPU", "GPU" or "MODEL") and its device id."""
    return args["model_instance_kind"], int(args["model_instance_device_id"])


def input_array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def input_text(request, name: str, max_bytes: int | None = None) -> str | None:
    array = input_array(request, name)
    if array is None:
        return None
    if array.size != 1:
        raise InvalidRequest(f"'{name}' must hold exactly one string, got {array.size}")
    value = array.reshape(-1)[0]
    if max_bytes is not None and len(value) > max_bytes:
        raise InvalidRequest(
            f"'{name}' has {len(value)} bytes; "
            f"this server takes at most {max_bytes} ({settings.MAX_REQUEST_BYTES.name})"
        )
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"'{name}' is not valid UTF-8: {exc}") from exc


def input_scalar(request, name: str) -> Any:
    array = input_array(request, name)
    if array is None:
        return None
    if array.size != 1:
        raise InvalidRequest(f"'{name}' must hold exactly one value, got {array.size}")
    return array.reshape(-1)[0].item()


def input_token_ids(request, name: str) -> np.ndarray | None:
    """The ids as a 1-D INT32 array (hashed, range-checked and forwarded without a Python list
    on the way), copied out of the request's shared memory, which it may outlive."""
    array = input_array(request, name)
    return None if array is None else array.reshape(-1).copy()


# The client contract's JSON inputs and their parsers.
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
BODY_PARSERS = {tensors.REQUEST: parse_chat_json, tensors.COMPLETION_REQUEST: parse_completion_json}


def chat_request(request, max_bytes: int) -> tuple[ChatRequest, str]:
    """The client contract's inputs -> one ChatRequest, and the form it came in
    (tensors.REQUEST: OpenAI chat JSON, tensors.COMPLETION_REQUEST: OpenAI completions JSON,
    or tensors.TEXT_INPUT)."""
    bodies = {name: body for name in BODY_PARSERS if (body := input_text(request, name, max_bytes)) is not None}
    text = input_text(request, tensors.TEXT_INPUT, max_bytes)
    scalars = {name: input_scalar(request, name) for name in tensors.SCALAR_INPUTS}
    given = sorted(name for name, value in scalars.items() if value is not None)
    if len(bodies) + (text is not None) > 1:
        raise InvalidRequest(
            f"give one of 'request' (JSON), '{tensors.COMPLETION_REQUEST}' (JSON) or 'text_input', not both"
        )
    if bodies:
        [(form, body)] = bodies.items()
        if given:
            raise InvalidRequest(
                f"with '{form}', put {', '.join(given)} inside the JSON body instead of separate inputs"
            )
        return BODY_PARSERS[form](body), form
    if text is None:
        raise InvalidRequest(
            f"one of 'request' (OpenAI chat JSON) or 'text_input' is required (or '{tensors.COMPLETION_REQUEST}')"
        )
    return text_input_request(text, **{k: v for k, v in scalars.items() if v is not None}), tensors.TEXT_INPUT


@dataclass(frozen=True)
class StageInput:
    """What prefill and decode work on, once its seal is checked."""

    prompt_token_ids: list[int]
    params: GenerationParams
    params_text: str  # as sealed: what a stage seals on for the next one
    kv_handle: KVHandle | None


def stage_input(request, seal: StageSeal, context_length: int, vocab_size: int) -> StageInput:
    """prefill/decode inputs, refused unless this server's renderer or chat sealed them
    (ids, generation params and KV handle as one), and unless the params fit the model."""
    ids = required_token_ids(request)
    params_text = input_text(request, tensors.GENERATION_PARAMS)
    if params_text is None:
        raise InvalidRequest(f"'{tensors.GENERATION_PARAMS}' is required")
    handle_text = input_text(request, tensors.KV_HANDLE) or ""
    seal.check_prompt(ids, params_text, handle_text, input_text(request, tensors.STAGE_SEAL))
    params = GenerationParams.from_json(params_text)
    params.check(len(ids), context_length, vocab_size)
    return StageInput(ids, params, params_text, KVHandle.from_json(handle_text) if handle_text else None)


def stage_inputs(
    ids: list[int], params_text: str, seal: str, kv_handle: str = "", first_output_sent: bool = False
) -> list[pb_utils.Tensor]:
    """The sealed inputs of a BLS call to prefill or decode (`first_output_sent`: decode's, unsealed)."""
    inputs = [
        int32_tensor(tensors.PROMPT_TOKEN_IDS, ids),
        string_tensor(tensors.GENERATION_PARAMS, params_text),
        string_tensor(tensors.STAGE_SEAL, seal),
    ]
    if kv_handle:
        inputs.append(string_tensor(tensors.KV_HANDLE, kv_handle))
    if first_output_sent:
        inputs.append(pb_utils.Tensor(tensors.FIRST_OUTPUT_SENT, np.array([True])))
    return inputs


def required_token_ids(request, name: str = tensors.PROMPT_TOKEN_IDS) -> list[int]:
    ids = input_token_ids(request, name)
    if ids is None or ids.size == 0:
        raise InvalidRequest(f"'{name}' is required and must not be empty")
    return ids.tolist()  # the engine's generation keeps a Python list it appends to


def string_tensor(name: str, value: str) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


def int32_tensor(name: str, values: list[int]) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.asarray(values, dtype=np.int32))


def client_tensors(output: ClientOutput, wanted: frozenset[str] | None = None) -> list[pb_utils.Tensor]:
    """`output` as the client outputs named in `wanted` (None: all of them).

    NOTE: a response costs a send per process it crosses and each tensor is built, copied
    and serialized on the way: what the caller did not request is never built."""
    builders = (
        (tensors.TEXT_OUTPUT, string_tensor, output.text_output),
        (tensors.RESPONSE, string_tensor, output.response),
        (tensors.PROMPT_TOKEN_IDS, int32_tensor, output.prompt_token_ids),
        (tensors.OUTPUT_TOKEN_IDS, int32_tensor, output.output_token_ids),
        (tensors.FINISH_REASON, string_tensor, output.finish_reason),
    )
    return [build(name, value) for name, build, value in builders if wanted is None or name in wanted]


def heartbeat_s(request) -> float | None:
    """The seconds between empty responses `request`'s caller asked for (None: it asked for
    none); InvalidRequest for a value that is not a positive integer."""
    value = _parameters(request).get(tensors.HEARTBEAT_MS)
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise InvalidRequest(f"request parameter '{tensors.HEARTBEAT_MS}' must be a positive integer, got {value!r}")
    return value / 1000


def ticket_requested(request) -> bool:
    """Whether `request`'s caller asked chat for a ticket (tensors.DECODE_TICKET)."""
    return bool_parameter(request, tensors.DECODE_TICKET)


def feed_grant_requested(request) -> str | None:
    """The decode feed `request`'s caller asks chat to grant with its ticket
    (tensors.DECODE_FEED_GRANT), None where it asks none; InvalidRequest as `feed_opened`."""
    return _feed_id(_parameters(request), tensors.DECODE_FEED_GRANT)


def feed_opened(request) -> str | None:
    """The feed `request` opens (its parameter tensors.DECODE_FEED_OPEN), None for any other
    request; InvalidRequest for an id that is not a string of 1 to 128 characters."""
    return _feed_id(_parameters(request), tensors.DECODE_FEED_OPEN)


def feed_named(request) -> tuple[str | None, str]:
    """The feed `request`'s outputs go through, and its key there (tensors.DECODE_FEED and
    DECODE_FEED_KEY); (None, "") where it names none."""
    parameters = _parameters(request)
    feed = _feed_id(parameters, tensors.DECODE_FEED)
    key = _feed_id(parameters, tensors.DECODE_FEED_KEY)
    if (feed is None) != (key is None):
        raise InvalidRequest(f"request parameters '{tensors.DECODE_FEED}' and '{tensors.DECODE_FEED_KEY}' go together")
    return feed, key or ""


def _feed_id(parameters: dict[str, Any], name: str) -> str | None:
    value = parameters.get(name)
    if value is None:
        return None
    if type(value) is not str or not 0 < len(value) <= 128:
        raise InvalidRequest(f"request parameter '{name}' must be a string of 1 to 128 characters, got {value!r}")
    return value


def kv_owner(request) -> str:
    """The caller `request`'s KV reservation counts against (tensors.KV_OWNER), "" where it
    names none; InvalidRequest for a value that is not a string of 1 to 128 characters."""
    value = _parameters(request).get(tensors.KV_OWNER, "")
    if value == "":
        return ""
    if type(value) is not str or len(value) > 128:
        raise InvalidRequest(f"request parameter '{tensors.KV_OWNER}' must be a string of 1 to 128 characters")
    return value


def bool_parameter(request, name: str) -> bool:
    """Request parameter `name` (False when absent); InvalidRequest for a value that is not a bool."""
    value = _parameters(request).get(name, False)
    if type(value) is not bool:
        raise InvalidRequest(f"request parameter '{name}' must be a bool, got {value!r}")
    return value


def _parameters(request) -> dict[str, Any]:
    """The request parameters a caller sent (Triton's parameters, as JSON)."""
    return json.loads(request.parameters() or "{}")


def heartbeat() -> pb_utils.InferenceResponse:
    """A response of no outputs: the stream is alive, nothing new (see tensors.HEARTBEAT_MS)."""
    return pb_utils.InferenceResponse(output_tensors=[])


def requested_client_outputs(request) -> frozenset[str]:
    """The client outputs `request` asked for (Triton lists every output when it named none)."""
    return frozenset(request.requested_output_names()) & frozenset(tensors.CLIENT_OUTPUTS)


def send_tensors(sender, output_tensors: list[pb_utils.Tensor], flags: int = 0) -> None:
    """Send a response of these tensors, holding them until the send returns.

    Why: Triton 2.51's stub drops the outputs a caller did not request inside send(),
    without the GIL; were its reference to such a tensor the last, the tensor's numpy
    array would be freed there, racing every Python thread's allocator (python_backend
    r25.01 takes the GIL there). `output_tensors` outlives the call, so the last reference
    is Python's, dropped under the GIL."""
    sender.send(pb_utils.InferenceResponse(output_tensors=output_tensors), flags=flags)


def failed_tensors(exc: Exception) -> list[pb_utils.Tensor]:
    """A stream that fails after it started ends with this in-band failure, not a Triton
    error response: in Triton 2.51 an error response to a decoupled BLS caller never
    reaches it (chat's client would wait forever). `chat` turns it into a Triton error;
    other clients read finish_reason "error" and the message in `response`."""
    error = {"message": tagged_message(exc), "type": error_code(exc).triton_code}
    body = json.dumps({"error": error}, ensure_ascii=False)
    return client_tensors(ClientOutput("", body, finish_reason=FAILED))


def failure_as_error(response) -> pb_utils.InferenceResponse:
    """A stage's in-band failure (see failed_tensors) as the Triton error it stands for."""
    body = pb_utils.get_output_tensor_by_name(response, tensors.RESPONSE).as_numpy()[0]
    message = json.loads(body)["error"]["message"]
    return pb_utils.InferenceResponse(error=_triton_error(parse_tag(message)[0] or ErrorCode.INTERNAL, message))


def triton_error(exc: Exception) -> pb_utils.TritonError:
    """`exc` as a Triton error of its code (core.errors), its message tagged with it too."""
    return _triton_error(error_code(exc), tagged_message(exc))


def _triton_error(code: ErrorCode, message: str) -> pb_utils.TritonError:
    # (TritonError exists only once the stub runs a model, not at import.)
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code.triton_code))


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=triton_error(exc))


def decode_stream(request, sender, key: str, assembler, *, given_first: bool, kv) -> DecodeStream:
    """decode's stream of `request` (its requested outputs, heartbeats and feed) under `key`."""
    feed, feed_key = feed_named(request)
    return DecodeStream(
        key,
        sender,
        assembler,
        requested_client_outputs(request),
        heartbeat_s(request),
        given_first=given_first,
        kv=kv,
        feed=feed,
        feed_key=feed_key,
    )


class StreamTransport:
    """decode's streams and feeds (core.output.decode_streams, core.output.feeds) over Triton
    response senders."""

    @staticmethod
    def send_output(sender, output: ClientOutput, wanted: frozenset[str], fed: int | None) -> None:
        output_tensors = client_tensors(output, wanted)
        if fed is not None:
            output_tensors.append(int32_tensor(tensors.FED_OUTPUTS, [fed]))
        send_tensors(sender, output_tensors, flags=FINAL if output.final else 0)

    @staticmethod
    def heartbeat(sender) -> None:
        sender.send(heartbeat())

    @staticmethod
    def fail(sender, error: Exception) -> None:
        send_tensors(sender, failed_tensors(error), flags=FINAL)

    @staticmethod
    def send(sender, keys: list[str], responses: list[str]) -> None:
        keys_array = np.array([key.encode() for key in keys], dtype=np.object_)
        bodies = np.array([body.encode() for body in responses], dtype=np.object_)
        outputs = [pb_utils.Tensor(tensors.FEED_KEYS, keys_array), pb_utils.Tensor(tensors.FEED_RESPONSES, bodies)]
        send_tensors(sender, outputs)

    @staticmethod
    def end(sender, error: Exception | None) -> None:
        if error is None:
            sender.send(flags=FINAL)
        else:
            sender.send(error_response(error), flags=FINAL)
