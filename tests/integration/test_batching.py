"""Continuous batching on a real tritonserver: requests served together get exactly the
tokens each gets alone (greedy, fp32), on the render path and on the reuse path with a
local, chunked prefill; over decode's limits a request gets UNAVAILABLE naming the limit."""

from __future__ import annotations

import threading

import pytest

from pdchat.clients.chat import ChatError, GrpcChat, chat_inputs, collect
from pdchat.core.errors import ErrorCode
from tests.conversations import CONVERSATIONS
from tests.integration.helpers import chat_renders, metric, wait_for


def bodies() -> list[dict]:
    """Eight greedy requests of different prompt and answer lengths (one over a 512-token chunk)."""
    chats = [{"messages": messages} for messages in CONVERSATIONS.values()][:6]
    chats.append({"messages": [{"role": "user", "content": "Summarize: " + "the quick brown fox " * 200}]})
    chats.append({"messages": [{"role": "user", "content": "Hi"}]})
    return [{**chat, "max_tokens": 6 + 3 * i, "temperature": 0, "stream": True} for i, chat in enumerate(chats)]


def together(url: str, requests: list[dict]) -> list[list[int]]:
    answers: list[list[int] | None] = [None] * len(requests)

    def run(index: int) -> None:
        client = GrpcChat(url)
        try:
            answers[index] = collect(client.stream(chat_inputs(**requests[index]))).output_token_ids
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return answers


def test_batched_requests_get_the_tokens_each_gets_alone_on_the_render_path(server):
    client = GrpcChat(server.grpc_url)
    requests = [{"request": body} for body in bodies()]
    alone = [collect(client.stream(chat_inputs(**r))).output_token_ids for r in requests]
    client.close()
    assert together(server.grpc_url, requests) == alone


def sampled_bodies() -> list[dict]:
    """Sixteen seeded, sampled requests (OpenAI's default temperature 1.0 with top_p 0.95,
    and each other shaping field on some), each with a prompt and seed of its own."""
    shaping = [
        {},
        {"top_k": 20},
        {"min_p": 0.05},
        {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.2},
        {"logit_bias": {"13": 5.0}},
        {"min_tokens": 4},
        {"temperature": 0.7, "top_p": 1.0},
    ]
    chats = [{"messages": messages} for messages in CONVERSATIONS.values()]
    return [
        {
            **chats[i % len(chats)],
            "temperature": 1.0,
            "top_p": 0.95,
            **shaping[i % len(shaping)],
            "seed": 1000 + i,
            "max_tokens": 8 + i,
            "stream": True,
        }
        for i in range(16)
    ]


def test_a_seeded_sampled_answer_is_the_same_alone_and_in_a_batch_of_16(server, kernels):
    """A draw depends on the request's seed and output position alone, never on its rows'
    neighbours: a request's logits are the same bits alone and in a batch, whoever prefills
    it (docs/cpu-engine.md#gemms-batch-invariant). That takes the C prompt attention besides
    the blocked GEMMs: with torch's, a prompt computed in other chunks agrees to rounding
    only, and a draw at a flat distribution's top_p edge turns on the low bits."""
    if not kernels.prompt_attention_max_dim:
        pytest.skip("the batch invariance of a prompt's pass needs the C prompt attention (AVX-512)")
    client = GrpcChat(server.grpc_url)
    requests = [{"request": body} for body in sampled_bodies()]
    alone = [collect(client.stream(chat_inputs(**r))).output_token_ids for r in requests]
    client.close()
    assert len({tuple(a) for a in alone}) == len(alone), "the draws are not all alike"
    assert together(server.grpc_url, requests) == alone


def test_batched_local_prefills_get_the_tokens_each_gets_alone_on_the_reuse_path(trusted_server):
    """Forwarded ids without KV: decode prefills them itself, in chunks, between steps."""
    client = GrpcChat(trusted_server.grpc_url)
    requests = []
    for body in bodies():
        [handed] = client.stream(
            chat_inputs({**body, "stream": False, "max_tokens": 1}, kv_transfer_params={"do_remote_decode": True})
        )
        requests.append({"request": body, "prompt_token_ids": handed.prompt_token_ids, "kv_transfer_params": {}})
    assert max(len(r["prompt_token_ids"]) for r in requests) > 512
    alone = [collect(client.stream(chat_inputs(**r))).output_token_ids for r in requests]
    client.close()
    assert together(trusted_server.grpc_url, requests) == alone


def test_over_the_limit_a_request_waits_then_gets_unavailable_naming_it(one_slot_server):
    holder = GrpcChat(one_slot_server.grpc_url)
    stream = holder.stream(
        chat_inputs(
            {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        )
    )
    next(stream)  # it holds decode's one slot
    client = GrpcChat(one_slot_server.grpc_url)
    with pytest.raises(ChatError) as info:
        collect(client.stream(chat_inputs({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})))
    assert info.value.code is ErrorCode.UNAVAILABLE and "max_running=1" in str(info.value)
    assert metric(one_slot_server, "pdchat_decode_active") == 1, "a refused request is not active, the holder still is"
    # Prefill's KV for the refused request, never pulled, is freed now, not at its 60 s TTL.
    assert wait_for(lambda: metric(one_slot_server, "pdchat_kv_held_bytes") == 0, timeout=10)
    stream.close()  # leaving cancels the holder; the slot frees
    assert wait_for(lambda: metric(one_slot_server, "pdchat_decode_active") == 0, timeout=30)
    assert collect(
        client.stream(chat_inputs({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    ).finish_reason
    for c in (holder, client):
        c.close()


def test_a_long_prompts_prefill_does_not_hold_up_the_next_prompt(server):
    """chat has a lane per prefill instance: a short prompt sent while a long one prefills
    gets its answer first (with one lane it would queue behind the long prefill)."""
    long_body = {
        "messages": [{"role": "user", "content": "Summarize: " + "the quick brown fox " * 2500}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }
    short_body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0, "stream": True}
    finished: list[str] = []
    rendered = chat_renders(server)

    def ask(name: str, body: dict) -> None:
        client = GrpcChat(server.grpc_url)
        try:
            collect(client.stream(chat_inputs(body)))
            finished.append(name)
        finally:
            client.close()

    long_request = threading.Thread(target=ask, args=("long", long_body))
    long_request.start()
    assert wait_for(lambda: chat_renders(server) > rendered, timeout=60), "the long prompt was not rendered"
    ask("short", short_body)  # the long prompt is now prefilling (or about to, in its lane)
    long_request.join(300)
    assert finished == ["short", "long"]
