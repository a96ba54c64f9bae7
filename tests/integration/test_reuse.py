"""`chat`: reuse of forwarded prompt ids, the signed gate, and parity of both paths.

The decode-role server plays both parts here: it signs (do_remote_decode) and verifies.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pdchat import tensors
from pdchat.clients.chat import GrpcChat, HttpChat, chat_inputs
from tests.conversations import PARITY_CASES, SAMPLING_CASES, chat_body
from tests.integration.adversarial import ADVERSARIAL
from tests.integration.conftest import SHORT_TTL_S
from tests.integration.helpers import answers_of, ask, chat_renders, metric, refusal, responses, summary
from tests.logprobs import assert_logprobs_close, logprobs_of

CHAT = "chat"


@pytest.fixture(scope="module")
def clients(decode_server):
    made = {"grpc": GrpcChat(decode_server.grpc_url, CHAT), "http": HttpChat(decode_server.http_url, CHAT)}
    yield made
    for client in made.values():
        client.close()


def prefill(client, body):
    """The prefill leg: first token, prompt ids and signed kv_transfer_params."""
    [output] = list(client.stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
    assert output.kv_transfer_params["signature"] and len(output.output_token_ids) == 1
    return output


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_render_and_reuse_paths_give_identical_answers(clients, case):
    body = {"max_tokens": 16, "temperature": 0, **PARITY_CASES[case]}
    seen = {}
    for protocol, client in clients.items():
        for stream in (False, True):
            request = {**body, "stream": stream}
            handed = prefill(clients["grpc"], body)  # a handoff is single-use
            rendered = ask(client, request)
            reused = ask(
                client, request, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params
            )
            assert reused.prompt_token_ids == rendered.prompt_token_ids == handed.prompt_token_ids
            assert summary(reused) == summary(rendered), (protocol, stream)
            seen[(protocol, stream)] = summary(rendered)
    assert len({json.dumps(s, sort_keys=True) for s in seen.values()}) == 1, (
        "transports or streaming changed the answer"
    )
    answer = seen[("grpc", False)]
    assert answer["ids"][0] == handed.output_token_ids[0], "prefill's first token starts the answer"
    if case in ("tool_required", "tool_named"):
        assert answer["finish_reason"] == "tool_calls" and answer["tool_calls"][0][0] == "pick_number"
    if case == "json_schema":
        assert set(json.loads(answer["content"])) == {"answer", "sure"}
    if case == "reasoning_open":
        assert answer["reasoning"] and not answer["content"]
    if case == "stop_strings":
        assert answer["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def monolithic_sampling(server):
    """The monolithic server's `chat` (render path): the reference for the sampling fields."""
    client = GrpcChat(server.grpc_url, CHAT)
    yield {
        stream: answers_of(client, {name: {**body, "stream": stream} for name, body in SAMPLING_CASES.items()})
        for stream in (False, True)
    }
    client.close()


def assert_same_answer(result, expected, where):
    assert result.output_token_ids == expected.output_token_ids, where
    assert result.finish_reason == expected.finish_reason, where
    assert_logprobs_close(logprobs_of(responses(result)), logprobs_of(responses(expected)))


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_fields_and_logprobs_equal_on_chat_ensemble_and_the_reuse_path(
    server, clients, monolithic_sampling, case
):
    """Penalties, biases, limits and logprobs: the same tokens and logprobs (1e-4) on every path
    of one server and of the prefill/decode handoff, streamed and not. The first token's
    logprobs come from prefill: as a tensor within a server, in the signed KV handle across."""
    ensemble = GrpcChat(server.grpc_url, "chat_ensemble")
    for stream in (False, True):
        body, expected = {**SAMPLING_CASES[case], "stream": stream}, monolithic_sampling[stream][case]
        assert len(logprobs_of(responses(expected))) == len(expected.output_token_ids)
        handed = prefill(clients["grpc"], body)
        assert_logprobs_close(logprobs_of([handed.response]), logprobs_of(responses(expected))[:1])
        assert "first_token_logprobs" in handed.kv_transfer_params["kv_handle"]
        reused = ask(
            clients["http"],
            body,
            prompt_token_ids=handed.prompt_token_ids,
            kv_transfer_params=handed.kv_transfer_params,
        )
        assert_same_answer(reused, expected, ("reuse", stream))
        assert_same_answer(ask(ensemble, body), expected, ("chat_ensemble", stream))
        assert_same_answer(ask(clients["grpc"], body), expected, ("decode role, render path", stream))
    ensemble.close()


def test_a_prefill_leg_without_logprobs_still_hands_decode_its_kv(decode_server, clients, monolithic_sampling):
    """A prefill leg that did not ask for logprobs: decode pulls its KV all the same and
    computes the prompt's last token again for the first token's logprobs."""
    body = SAMPLING_CASES["greedy_logprobs"]
    handed = prefill(clients["grpc"], {**body, "logprobs": False, "top_logprobs": None})
    assert "first_token_logprobs" not in handed.kv_transfer_params["kv_handle"]
    pulled = metric(decode_server, "pdchat_kv_pulls_total", outcome="pulled")
    reused = ask(
        clients["grpc"], body, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params
    )
    assert_same_answer(
        reused, monolithic_sampling[False]["greedy_logprobs"], "first token's logprobs computed by decode"
    )
    assert metric(decode_server, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 1


def test_ids_inside_kv_transfer_params_vllm_style_are_reused_too(clients):
    body = chat_body("multi_turn", max_tokens=8, temperature=0)
    handed = prefill(clients["grpc"], body)
    listed = {**handed.kv_transfer_params, "prompt_token_ids": handed.prompt_token_ids}
    assert summary(ask(clients["http"], body, kv_transfer_params=listed)) == summary(ask(clients["http"], body))


def test_reuse_skips_the_renderer_and_the_render_path_runs_it(decode_server, clients):
    body = chat_body("system_prompt", max_tokens=4, temperature=0)
    handoffs = [prefill(clients["grpc"], body) for _ in range(3)]
    before = chat_renders(decode_server)
    for handed in handoffs:
        ask(
            clients["grpc"],
            body,
            prompt_token_ids=handed.prompt_token_ids,
            kv_transfer_params=handed.kv_transfer_params,
        )
    assert chat_renders(decode_server) == before
    ask(clients["grpc"], body)
    assert chat_renders(decode_server) == before + 1


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_bad_forwarded_ids_are_refused_with_their_reason_and_counted(decode_server, clients, case):
    body = chat_body("single_turn", max_tokens=4, temperature=0)
    handed = prefill(clients["grpc"], body)
    make, reason = ADVERSARIAL[case]
    before = metric(decode_server, "pdchat_forwarded_ids_total", outcome="rejected", reason=reason)
    message = refusal(clients["grpc"], body, **make(handed))
    assert f"forwarded prompt token ids refused ({reason})" in message
    assert metric(decode_server, "pdchat_forwarded_ids_total", outcome="rejected", reason=reason) == before + 1
    # The server keeps serving, and the genuine handoff still works.
    reused = ask(
        clients["grpc"], body, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params
    )
    assert reused.finish_reason == "length"


def test_a_replayed_handoff_is_refused_and_counted(decode_server, clients):
    body = chat_body("single_turn", max_tokens=3, temperature=0)
    handed = prefill(clients["grpc"], body)
    forwarded = {"prompt_token_ids": handed.prompt_token_ids, "kv_transfer_params": handed.kv_transfer_params}
    assert ask(clients["grpc"], body, **forwarded).finish_reason == "length"
    before = metric(decode_server, "pdchat_forwarded_ids_total", outcome="rejected", reason="replayed")
    assert "(replayed)" in refusal(clients["http"], body, **forwarded)
    assert metric(decode_server, "pdchat_forwarded_ids_total", outcome="rejected", reason="replayed") == before + 1


def test_a_handoff_whose_request_is_refused_stays_good_for_the_corrected_request(clients):
    """A red-team finding: the gate spent a handoff on a request refused after it (here for
    its max_tokens), so the corrected retry was refused as replayed."""
    body = chat_body("single_turn", max_tokens=3, temperature=0)
    handed = prefill(clients["grpc"], body)
    forwarded = {"prompt_token_ids": handed.prompt_token_ids, "kv_transfer_params": handed.kv_transfer_params}
    assert "max_tokens" in refusal(clients["grpc"], {**body, "max_tokens": 10**6}, **forwarded)
    assert ask(clients["grpc"], body, **forwarded).finish_reason == "length"
    assert "(replayed): this handoff was used already" in refusal(clients["grpc"], body, **forwarded)


def test_ids_signed_for_another_conversation_are_refused(clients):
    handed = prefill(clients["grpc"], chat_body("single_turn", max_tokens=4))
    message = refusal(
        clients["http"],
        chat_body("multi_turn", max_tokens=4),
        prompt_token_ids=handed.prompt_token_ids,
        kv_transfer_params=handed.kv_transfer_params,
    )
    assert "(fingerprint_mismatch): the ids were signed for a different conversation" in message


def test_router_may_change_sampling_but_not_render_inputs(clients):
    body = chat_body("single_turn", max_tokens=4, temperature=0)
    handed = prefill(clients["grpc"], body)
    changed_sampling = {**body, "max_tokens": 6, "temperature": 0.7, "seed": 9, "stream": True}
    assert (
        len(
            ask(
                clients["grpc"],
                changed_sampling,
                prompt_token_ids=handed.prompt_token_ids,
                kv_transfer_params=handed.kv_transfer_params,
            ).output_token_ids
        )
        == 6
    )
    changed_template = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert "fingerprint_mismatch" in refusal(
        clients["grpc"],
        changed_template,
        prompt_token_ids=handed.prompt_token_ids,
        kv_transfer_params=handed.kv_transfer_params,
    )


def test_accepted_reuse_is_counted_with_render_seconds_saved(decode_server, clients):
    body = {**PARITY_CASES["long_prompt"], "max_tokens": 2, "temperature": 0}
    handed = prefill(clients["grpc"], body)
    accepted = metric(decode_server, "pdchat_forwarded_ids_total", outcome="accepted")
    skipped = metric(decode_server, "pdchat_renders_skipped_total")
    saved = metric(decode_server, "pdchat_render_seconds_saved_total")
    ask(clients["grpc"], body, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params)
    assert metric(decode_server, "pdchat_forwarded_ids_total", outcome="accepted") == accepted + 1
    assert metric(decode_server, "pdchat_renders_skipped_total") == skipped + 1
    assert metric(decode_server, "pdchat_render_seconds_saved_total") > saved


def test_policy_off_refuses_forwarded_ids(server):
    client = GrpcChat(server.grpc_url, CHAT)
    body = chat_body("single_turn", max_tokens=3, temperature=0)
    ids = ask(client, body).prompt_token_ids
    assert "(policy_off)" in refusal(client, body, prompt_token_ids=ids)
    assert "(policy_off)" in refusal(client, body, kv_transfer_params={"prompt_token_ids": ids})
    assert "needs this server to have a handoff key" in refusal(
        client, body, kv_transfer_params={"do_remote_decode": True}
    )
    client.close()


def test_chat_render_path_equals_chat_ensemble(server):
    chat, ensemble = GrpcChat(server.grpc_url, CHAT), GrpcChat(server.grpc_url, "chat_ensemble")
    for name in ("unicode_emoji", "tool_result"):
        body = chat_body(name, max_tokens=10, temperature=0, stream=True)
        assert summary(ask(chat, body)) == summary(ask(ensemble, body))
    chat.close()
    ensemble.close()


def test_trusted_policy_accepts_unsigned_ids_and_still_checks_them(trusted_server):
    client = GrpcChat(trusted_server.grpc_url, CHAT)
    body = chat_body("multi_turn", max_tokens=6, temperature=0)
    rendered = ask(client, body)
    reused = ask(client, body, kv_transfer_params={"prompt_token_ids": rendered.prompt_token_ids})
    assert summary(reused) == summary(rendered)
    assert "(out_of_vocabulary)" in refusal(client, body, prompt_token_ids=[3, 10**7])
    client.close()


def test_expired_handoff_is_refused(trusted_server):
    client = GrpcChat(trusted_server.grpc_url, CHAT)
    body = chat_body("single_turn", max_tokens=3, temperature=0)
    handed = prefill(client, body)
    time.sleep(SHORT_TTL_S + 0.5)
    message = refusal(
        client, body, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params
    )
    assert "(expired): the handoff expired" in message
    client.close()


def test_binary_ids_keep_their_dtype_over_grpc(decode_server):
    inputs = chat_inputs(chat_body("single_turn", max_tokens=2), prompt_token_ids=np.array([1, 2, 3], dtype=np.int64))
    assert inputs["prompt_token_ids"].dtype == np.int32


def test_top_level_prompt_token_ids_are_forwarded_ids_admitted_only_signed(clients):
    """vLLM's newer wire form (#55771): the ids at the top level of the JSON body, beside the
    kv_transfer_params prefill returned. Signed, decode admits them and skips the render;
    alone, the gate refuses them as it refuses unsigned ids in any form."""
    body = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 8, "temperature": 0}
    rendered = ask(clients["http"], body)
    handed = prefill(clients["grpc"], body)
    signed = {**body, "prompt_token_ids": handed.prompt_token_ids, "kv_transfer_params": handed.kv_transfer_params}
    reused = ask(clients["http"], signed)
    assert reused.output_token_ids == rendered.output_token_ids
    assert "refused (unsigned)" in refusal(clients["http"], {**body, "prompt_token_ids": handed.prompt_token_ids})
    twice = refusal(
        clients["grpc"], {**body, "prompt_token_ids": handed.prompt_token_ids}, prompt_token_ids=handed.prompt_token_ids
    )
    assert "give the ids once" in twice
    assert "prompt_token_ids must be a list of integers" in refusal(
        clients["http"], {**body, "prompt_token_ids": ["x"]}
    )


@pytest.mark.parametrize("path", ["render", "reuse"])
def test_a_client_requesting_only_response_gets_only_response_and_the_same_answer(clients, decode_server, path):
    """A client may request a subset of the outputs (the fronts request what they read): chat
    still reads decode's finish_reason for its relay, and the answer is unchanged."""
    body = chat_body("multi_turn", max_tokens=6, temperature=0, stream=True)
    lean = GrpcChat(decode_server.grpc_url, CHAT, outputs=(tensors.RESPONSE,))
    try:
        answers = []
        for client in (clients["grpc"], lean):
            handed = {}
            if path == "reuse":
                output = prefill(clients["grpc"], body)
                handed = {"prompt_token_ids": output.prompt_token_ids, "kv_transfer_params": output.kv_transfer_params}
            answers.append(ask(client, body, **handed))
    finally:
        lean.close()
    full, only = answers
    assert full.text and full.output_token_ids and full.prompt_token_ids and full.finish_reason
    assert not (only.text or only.output_token_ids or only.prompt_token_ids or only.finish_reason)
    assert [strip_ids(chunk) for chunk in responses(only)] == [strip_ids(chunk) for chunk in responses(full)]


def strip_ids(chunk: dict) -> dict:
    return {key: value for key, value in chunk.items() if key not in ("id", "created")}


def test_a_heartbeat_parameter_that_is_no_positive_integer_is_refused_naming_it(decode_server):
    import queue

    import tritonclient.grpc as grpcclient

    body = np.array([json.dumps(chat_body("single_turn", max_tokens=2)).encode()], dtype=np.object_)
    request = grpcclient.InferInput(tensors.REQUEST, [1], "BYTES")
    request.set_data_from_numpy(body)
    for bad in ("50", 0):
        client, results = grpcclient.InferenceServerClient(decode_server.grpc_url), queue.Queue()
        client.start_stream(callback=lambda result, error, results=results: results.put(error))
        try:
            client.async_stream_infer(CHAT, [request], parameters={tensors.HEARTBEAT_MS: bad})
            error = results.get(timeout=60)
        finally:
            client.stop_stream()
            client.close()
        assert "request parameter 'heartbeat_ms' must be a positive integer" in str(error), error
