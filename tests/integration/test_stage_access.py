"""Only the client-facing models answer clients: stage models refuse unsealed input.

A direct call to `decode` or `prefill` is what a hostile client would try to walk
around the gate: ids that never met the chat template, unchecked generation params,
someone else's KV handle. Each is refused with INVALID_ARG naming why, and the server
keeps serving.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pdchat import tensors
from pdchat.clients.chat import ChatError, GrpcChat, chat_inputs, collect
from pdchat.core.errors import ErrorCode, parse_tag
from pdchat.ensemble.seal import StageSeal
from tests.conversations import chat_body

UNSEALED = "stage models take only input sealed by this server's renderer or chat model"


def infer(server, model, **named):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, value in named.items():
        array = (
            np.asarray(value, dtype=np.int32)
            if name == tensors.PROMPT_TOKEN_IDS
            else np.array([value.encode()], dtype=np.object_)
        )
        entry = grpcclient.InferInput(name, list(array.shape), "INT32" if array.dtype == np.int32 else "BYTES")
        entry.set_data_from_numpy(array)
        inputs.append(entry)
    try:
        if model == "decode":  # decoupled: one stream, first response or error
            results = []
            client.start_stream(callback=lambda result, error: results.append(error or result))
            client.async_stream_infer(model, inputs)
            client.stop_stream()
            if isinstance(results[0], Exception):
                raise results[0]
            return results[0]
        return client.infer(model, inputs)
    finally:
        client.close()


def refusal(server, model, **named) -> str:
    with pytest.raises(InferenceServerException) as info:
        infer(server, model, **named)
    # Stream errors carry no gRPC status in tritonclient; pdchat's messages carry the code in their tag.
    status, (code, _) = info.value.status(), parse_tag(info.value.message())
    assert status == "StatusCode.INVALID_ARGUMENT" or code is ErrorCode.INVALID_ARG, info.value
    return info.value.message()


def render(server) -> dict[str, np.ndarray]:
    """What the renderer hands prefill for one request: ids, params and its seal."""
    result = infer(server, "renderer", request=json.dumps(chat_body("single_turn", max_tokens=4, temperature=0)))
    return {
        name: result.as_numpy(name)
        for name in (tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS, tensors.STAGE_SEAL)
    }


@pytest.fixture(scope="module")
def rendered(server):
    return render(server)


def text(array) -> str:
    return array[0].decode()


def test_sealed_input_from_the_renderer_opens_prefill(server, rendered):
    result = infer(
        server,
        "prefill",
        prompt_token_ids=rendered["prompt_token_ids"],
        generation_params=text(rendered["generation_params"]),
        stage_seal=text(rendered["stage_seal"]),
    )
    assert result.as_numpy("first_token_id").shape == (1,)


@pytest.mark.parametrize("model", ["prefill", "decode"])
def test_ids_without_the_template_are_refused(server, rendered, model):
    params = text(rendered["generation_params"])
    assert UNSEALED in refusal(server, model, prompt_token_ids=[1, 2, 3], generation_params=params, stage_seal="0" * 64)
    # The renderer's seal does not stretch to other ids, or to altered params.
    seal = text(rendered["stage_seal"])
    assert UNSEALED in refusal(server, model, prompt_token_ids=[1, 2, 3], generation_params=params, stage_seal=seal)
    hotter = json.dumps({**json.loads(params), "temperature": -5.0})
    assert UNSEALED in refusal(
        server, model, prompt_token_ids=rendered["prompt_token_ids"], generation_params=hotter, stage_seal=seal
    )
    longer = json.dumps({**json.loads(params), "max_tokens": 16_300})
    assert UNSEALED in refusal(
        server, model, prompt_token_ids=rendered["prompt_token_ids"], generation_params=longer, stage_seal=seal
    )


def test_a_kv_handle_needs_the_gate_s_seal(server, rendered):
    handle = json.dumps(
        {
            "connector": "shm",
            "shape": [4, 2, 2, 8, 64],
            "expires_at": 9e9,
            "first_token_id": 1,
            "location": {"name": "pdchat_kv_0123456789ab_99999999999999_00"},
        }
    )
    message = refusal(
        server,
        "decode",
        prompt_token_ids=rendered["prompt_token_ids"],
        generation_params=text(rendered["generation_params"]),
        stage_seal=text(rendered["stage_seal"]),
        kv_handle=handle,
    )
    assert UNSEALED in message


@pytest.mark.parametrize("own", ["kv_cache", "first_token_id"])
def test_decode_takes_no_kv_or_first_token_of_a_client_s_own(server, rendered, own):
    """Prefill's KV and first token reach decode only inside prefill's sealed handle: a
    client's own (a red-team finding: an out-of-vocabulary first token failed every stream
    of the batch) is not even an input."""
    value = np.zeros((4, 2, 2, 8, 64), dtype=np.float32) if own == "kv_cache" else np.array([10**6], dtype=np.int32)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, array in [
        ("prompt_token_ids", rendered["prompt_token_ids"]),
        ("generation_params", rendered["generation_params"]),
        ("stage_seal", rendered["stage_seal"]),
        (own, value),
    ]:
        entry = grpcclient.InferInput(
            name, list(array.shape), {"i": "INT32", "f": "FP32"}.get(array.dtype.kind, "BYTES")
        )
        entry.set_data_from_numpy(array)
        inputs.append(entry)
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("decode", inputs)
    client.stop_stream()
    client.close()
    assert errors and errors[0] is not None and f"unexpected inference input '{own}'" in str(errors[0])


def test_a_cancellation_needs_chat_s_seal(server):
    message = refusal(server, "decode", cancel_request_id="chatcmpl-0", stage_seal="x")
    assert "a cancellation refused (malformed: " in message


def test_a_sealed_input_opens_prefill_once(server):
    """A red-team finding: a client who saw one sealed input (the renderer's answer) sent it
    to prefill again and again, each call holding KV."""
    captured = render(server)
    ids, params, seal = (
        captured[tensors.PROMPT_TOKEN_IDS],
        text(captured[tensors.GENERATION_PARAMS]),
        text(captured[tensors.STAGE_SEAL]),
    )
    result = infer(server, "prefill", prompt_token_ids=ids, generation_params=params, stage_seal=seal)
    assert result.as_numpy("first_token_id").shape == (1,)
    for _ in range(3):  # prefill runs two instances: a replay reaches either
        message = refusal(server, "prefill", prompt_token_ids=ids, generation_params=params, stage_seal=seal)
        assert "(replayed: this seal opened a stage already" in message and UNSEALED in message


def test_an_expired_seal_is_refused(server, rendered):
    ids, params = rendered[tensors.PROMPT_TOKEN_IDS], text(rendered[tensors.GENERATION_PARAMS])
    late = StageSeal.of_server(server.process.pid)  # this server's key, read as a tool of its user reads it
    late.ttl_s = -1.0  # sealed a second past its expiry
    seal = late.seal_prompt(ids.tolist(), params)
    message = refusal(server, "prefill", prompt_token_ids=ids, generation_params=params, stage_seal=seal)
    assert "(expired: the seal expired" in message and "stage_seal_ttl_s" in message


def test_a_seal_opens_only_the_server_that_made_it(decode_server, trusted_server):
    """Two servers of one deployment (one handoff key): one's sealed input opens no stage of the other's."""
    theirs = render(decode_server)
    message = refusal(
        trusted_server,
        "prefill",
        prompt_token_ids=theirs[tensors.PROMPT_TOKEN_IDS],
        generation_params=text(theirs[tensors.GENERATION_PARAMS]),
        stage_seal=text(theirs[tensors.STAGE_SEAL]),
    )
    assert "(not this server's: sealed by another server" in message


def test_the_server_keeps_serving_after_the_refusals(server):
    client = GrpcChat(server.grpc_url)
    try:
        assert (
            len(
                collect(
                    client.stream(chat_inputs(chat_body("single_turn", max_tokens=3, temperature=0)))
                ).output_token_ids
            )
            == 3
        )
    finally:
        client.close()


@pytest.mark.parametrize("model", ["chat", "chat_ensemble"])
def test_an_oversized_body_is_refused_before_it_is_parsed(server, model):
    from pdchat.core.settings import MAX_REQUEST_BYTES

    limit = MAX_REQUEST_BYTES.default_value
    body = json.dumps({"messages": [{"role": "user", "content": "x" * limit}]})
    client = GrpcChat(server.grpc_url, model)
    try:
        with pytest.raises(ChatError) as info:
            collect(client.stream(chat_inputs(body)))
    finally:
        client.close()
    assert info.value.code is ErrorCode.INVALID_ARG
    assert f"this server takes at most {limit} (max_request_bytes)" in str(info.value)
