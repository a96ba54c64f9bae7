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
from pdchat.core.errors import INVALID_ARG, UNAVAILABLE, InvalidRequest, error_class, tagged_message
from pdchat.core.kv.base import KVHandle
from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.core.output.responses import ClientOutput
from pdchat.core.request.protocol import ChatRequest, GenerationParams, parse_chat_json, text_input_request
from pdchat.ensemble.seal import StageSeal


def declare_contract(config, inputs: tuple[tensors.TensorSpec, ...], outputs: tuple[tensors.TensorSpec, ...]):
    """auto_complete_config: a model's inputs and outputs from tensors.py, so the configs
    that serve it in several roles need not repeat them."""
    for spec in inputs:
        config.add_input({"name": spec.name, "data_type": spec.data_type, "dims": list(spec.dims), "optional": spec.optional})
    for spec in outputs:
        config.add_output({"name": spec.name, "data_type": spec.data_type, "dims": list(spec.dims)})
    return config


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt as a plain dict."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


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
        raise InvalidRequest(f"'{name}' has {len(value)} bytes; this server takes at most {max_bytes} ({settings.PARAM_MAX_REQUEST_BYTES})")
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


def input_token_ids(request, name: str) -> list[int] | None:
    array = input_array(request, name)
    return None if array is None else array.reshape(-1).astype(np.int64).tolist()


def chat_request(request, max_bytes: int) -> tuple[ChatRequest, str]:
    """The client contract's inputs -> one ChatRequest, and the form it came in
    (tensors.REQUEST: OpenAI JSON, or tensors.TEXT_INPUT)."""
    body = input_text(request, tensors.REQUEST, max_bytes)
    text = input_text(request, tensors.TEXT_INPUT, max_bytes)
    scalars = {name: input_scalar(request, name) for name in tensors.SCALAR_INPUTS}
    given = sorted(name for name, value in scalars.items() if value is not None)
    if body is not None and text is not None:
        raise InvalidRequest("give either 'request' (JSON) or 'text_input', not both")
    if body is not None:
        if given:
            raise InvalidRequest(f"with 'request', put {', '.join(given)} inside the JSON body instead of separate inputs")
        return parse_chat_json(body), tensors.REQUEST
    if text is None:
        raise InvalidRequest("one of 'request' (OpenAI chat JSON) or 'text_input' is required")
    return text_input_request(text, **{k: v for k, v in scalars.items() if v is not None}), tensors.TEXT_INPUT


@dataclass(frozen=True)
class StageInput:
    """What prefill and decode work on, once its seal is checked."""

    prompt_token_ids: list[int]
    params: GenerationParams
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
    return StageInput(ids, params, KVHandle.from_json(handle_text) if handle_text else None)


def stage_inputs(ids: list[int], params_text: str, seal: str, kv_handle: str = "") -> list[pb_utils.Tensor]:
    """The sealed inputs of a BLS call to prefill or decode."""
    inputs = [int32_tensor(tensors.PROMPT_TOKEN_IDS, ids), string_tensor(tensors.GENERATION_PARAMS, params_text),
              string_tensor(tensors.STAGE_SEAL, seal)]
    return inputs + ([string_tensor(tensors.KV_HANDLE, kv_handle)] if kv_handle else [])


def logprobs_tensor(logprobs: TokenLogprobs | None) -> pb_utils.Tensor:
    """Prefill's first_token_logprobs: the JSON entry, or "" when the request did not ask."""
    return string_tensor(tensors.FIRST_TOKEN_LOGPROBS, "" if logprobs is None else logprobs.to_json())


def input_logprobs(request) -> TokenLogprobs | None:
    text = input_text(request, tensors.FIRST_TOKEN_LOGPROBS)
    if not text:
        return None
    try:
        return TokenLogprobs.from_json(text)
    except ValueError as exc:
        raise InvalidRequest(f"'{tensors.FIRST_TOKEN_LOGPROBS}': {exc}") from None


def required_token_ids(request, name: str = tensors.PROMPT_TOKEN_IDS) -> list[int]:
    ids = input_token_ids(request, name)
    if not ids:
        raise InvalidRequest(f"'{name}' is required and must not be empty")
    return ids


def string_tensor(name: str, value: str) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


def int32_tensor(name: str, values: list[int]) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.asarray(values, dtype=np.int32))


def client_tensors(output: ClientOutput) -> list[pb_utils.Tensor]:
    return [
        string_tensor(tensors.TEXT_OUTPUT, output.text_output),
        string_tensor(tensors.RESPONSE, output.response),
        int32_tensor(tensors.PROMPT_TOKEN_IDS, output.prompt_token_ids),
        int32_tensor(tensors.OUTPUT_TOKEN_IDS, output.output_token_ids),
        string_tensor(tensors.FINISH_REASON, output.finish_reason),
    ]


def client_response(output: ClientOutput) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=client_tensors(output))


def triton_error(exc: Exception) -> pb_utils.TritonError:
    """InvalidRequest -> INVALID_ARG, Unavailable -> UNAVAILABLE, anything else -> INTERNAL;
    the message carries the class too (see core.errors)."""
    # (TritonError exists only once the stub runs a model, not at import.)
    codes = {INVALID_ARG: pb_utils.TritonError.INVALID_ARG, UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE}
    return pb_utils.TritonError(tagged_message(exc), codes.get(error_class(exc), pb_utils.TritonError.INTERNAL))


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=triton_error(exc))
