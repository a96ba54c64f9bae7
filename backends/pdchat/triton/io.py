"""Triton tensors <-> typed core values, and core errors -> Triton error codes.

Only the model.py adapters import this module: it needs the python backend's
`triton_python_backend_utils`, which exists inside the backend stub alone.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.errors import INVALID_ARG, UNAVAILABLE, InvalidRequest, error_class, tagged_message
from pdchat.core.protocol import ChatRequest, GenerationParams, parse_chat_json, text_input_request
from pdchat.core.responses import ClientOutput


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt as a plain dict."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def input_array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def input_text(request, name: str) -> str | None:
    array = input_array(request, name)
    if array is None:
        return None
    if array.size != 1:
        raise InvalidRequest(f"'{name}' must hold exactly one string, got {array.size}")
    value = array.reshape(-1)[0]
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


def chat_request(request) -> ChatRequest:
    """The client contract's inputs -> one ChatRequest (JSON body or text_input)."""
    body = input_text(request, tensors.REQUEST)
    text = input_text(request, tensors.TEXT_INPUT)
    scalars = {name: input_scalar(request, name) for name in tensors.SCALAR_INPUTS}
    given = sorted(name for name, value in scalars.items() if value is not None)
    if body is not None and text is not None:
        raise InvalidRequest("give either 'request' (JSON) or 'text_input', not both")
    if body is not None:
        if given:
            raise InvalidRequest(f"with 'request', put {', '.join(given)} inside the JSON body instead of separate inputs")
        return parse_chat_json(body)
    if text is None:
        raise InvalidRequest("one of 'request' (OpenAI chat JSON) or 'text_input' is required")
    return text_input_request(text, **{k: v for k, v in scalars.items() if v is not None})


def generation_params(request) -> GenerationParams:
    text = input_text(request, tensors.GENERATION_PARAMS)
    if text is None:
        raise InvalidRequest(f"'{tensors.GENERATION_PARAMS}' is required")
    return GenerationParams.from_json(text)


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
