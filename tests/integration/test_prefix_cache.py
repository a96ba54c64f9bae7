"""The paged KV pool and its prefix cache on a real tritonserver: a conversation sent again
gets the same greedy tokens from cached blocks and computes fewer prompt tokens; its next
turn hits this turn's blocks; another cache_salt shares nothing; decode's KV held follows
the tokens its requests hold, not the longest row; a request larger than the pool is
refused by name."""

from __future__ import annotations

import threading
import uuid

from pdchat.clients.chat import GrpcChat, HttpChat, chat_inputs, collect
from pdchat.core.errors import ErrorCode
from tests.integration.helpers import (
    ask,
    computed_since,
    conversation,
    metric,
    prompt_tokens_computed,
    refusal,
    wait_for,
)

BLOCK_TOKENS = 16
KV_BYTES_PER_TOKEN = 4096  # the tiny model: 4 layers x 2 x 2 kv heads x 64 x fp32


def cached_tokens(result) -> int:
    return result.outputs[-1].response["usage"]["prompt_tokens_details"]["cached_tokens"]


def common_prefix(first: list[int], second: list[int]) -> int:
    shared = 0
    for mine, theirs in zip(first, second, strict=False):
        if mine != theirs:
            break
        shared += 1
    return shared


def test_a_conversation_sent_again_gets_the_same_tokens_from_cached_blocks(server):
    """Computed once, by prefill or by an idle decode: sent again, all but the last block's
    tokens come from the cache of the stage that computes it then."""
    client = GrpcChat(server.grpc_url)
    body = conversation()
    before = prompt_tokens_computed(server)
    cold = ask(client, body)
    prompt = len(cold.prompt_token_ids)
    cold_computed = sum(computed_since(server, before, prompt).values())
    before = prompt_tokens_computed(server)
    warm = ask(client, body)
    warm_computed = sum(computed_since(server, before, prompt - cached_tokens(warm)).values())
    client.close()
    assert prompt > 200 and cached_tokens(cold) == 0
    assert cached_tokens(warm) == (prompt - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert warm.output_token_ids == cold.output_token_ids
    assert cold_computed == prompt and warm_computed == prompt - cached_tokens(warm)
    assert metric(server, "pdchat_prefix_cache_hits_tokens_total") >= cached_tokens(warm)


def test_the_next_turn_hits_the_blocks_of_this_turns_prompt_streamed_over_http(server):
    client = HttpChat(server.http_url)
    first = conversation(stream=True, stream_options={"include_usage": True})
    turn = ask(client, first)
    answer = "".join(
        o.response["choices"][0]["delta"].get("content") or "" for o in turn.outputs if o.response["choices"]
    )
    follow_up = {
        **first,
        "messages": first["messages"]
        + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the light?"}],
    }
    before = prompt_tokens_computed(server)
    next_turn = ask(client, follow_up)
    uncached = len(next_turn.prompt_token_ids) - cached_tokens(next_turn)
    prefilled_by_decode = computed_since(server, before, uncached)["decode"] > 0
    client.close()
    shared = common_prefix(turn.prompt_token_ids, next_turn.prompt_token_ids)
    assert shared >= len(turn.prompt_token_ids) - 1, "the next turn's prompt starts with this turn's"
    if prefilled_by_decode:  # decode's cache holds the answer's KV too: all but its last token went through a step
        shared = common_prefix(turn.prompt_token_ids + turn.output_token_ids[:-1], next_turn.prompt_token_ids)
    assert cached_tokens(next_turn) == min(shared, len(next_turn.prompt_token_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_requests_with_another_cache_salt_share_no_blocks(server):
    client = GrpcChat(server.grpc_url)
    body = conversation(salt="tenant-a")
    ask(client, body)
    other = ask(client, {**body, "cache_salt": "tenant-b"})
    unsalted = ask(client, {k: v for k, v in body.items() if k != "cache_salt"})
    # Its prompt is computed by prefill, or by decode while idle: the second of two asks finds
    # it in whichever stage computes it then (the first may go to the other stage).
    same = [ask(client, body) for _ in range(2)]
    client.close()
    assert cached_tokens(other) == 0 and cached_tokens(unsalted) == 0
    assert max(map(cached_tokens, same)) > 0
    assert same[0].output_token_ids == same[1].output_token_ids == other.output_token_ids
    assert "'cache_salt' must be a non-empty string" in refusal(GrpcChat(server.grpc_url), {**body, "cache_salt": ""})


def test_decodes_kv_held_follows_the_tokens_held_not_the_longest_row(server):
    """Fifteen short streams beside one ~14k-token prompt: decode's KV held stays within
    1.2x of what those requests can hold (the padded batch it replaced held ~8x)."""
    short = {"messages": [{"role": "user", "content": "Go on " * 120}], "max_tokens": 150, "ignore_eos": True}
    long_body = {
        "messages": [{"role": "user", "content": f"{uuid.uuid4()} " + "the quick brown fox " * 3600}],
        "max_tokens": 40,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(metric(server, "pdchat_decode_kv_bytes"))
            done.wait(0.2)

    def run_short() -> None:
        streams = GrpcChat(server.grpc_url)
        try:
            collect(streams.stream(chat_inputs({**short, "stream": True})))
        finally:
            streams.close()

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=run_short) for _ in range(15)]
    for thread in threads:
        thread.start()
    client = GrpcChat(server.grpc_url, timeout_s=300)
    long_answer = ask(client, long_body)
    for thread in threads:
        thread.join(300)
    done.set()
    sampler.join()
    short_prompt = len(ask(client, {**short, "max_tokens": 1, "return_token_ids": True}).prompt_token_ids)
    client.close()
    long_prompt = len(long_answer.prompt_token_ids)
    can_hold = (15 * (short_prompt + 150) + long_prompt + 40) * KV_BYTES_PER_TOKEN
    assert long_prompt > 14_000 and len(long_answer.output_token_ids) == 40
    assert max(samples) > long_prompt * KV_BYTES_PER_TOKEN, "sampled while the long prompt was held"
    assert max(samples) <= 1.2 * can_hold, f"{max(samples) / can_hold:.2f}x the tokens held"
    assert wait_for(lambda: metric(server, "pdchat_decode_kv_bytes") == 0)


def test_a_request_larger_than_the_pool_is_refused_and_the_rest_wait_their_turn(small_pool_server):
    client = GrpcChat(small_pool_server.grpc_url)
    body = {"messages": [{"role": "user", "content": "Go on"}], "temperature": 0, "ignore_eos": True}
    message = refusal(client, {**body, "max_tokens": 2000})
    assert "whole KV pool of 64 blocks (decode_kv_mb)" in message, message
    results: list = []

    def run() -> None:
        own = GrpcChat(small_pool_server.grpc_url)
        try:
            results.append(collect(own.stream(chat_inputs({**body, "max_tokens": 400, "stream": True}))))
        except Exception as exc:  # noqa: BLE001 - an UNAVAILABLE after the queue timeout is an answer too
            results.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=run) for _ in range(4)]  # 4 x 26 blocks in a 64-block pool
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    answered = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(results) == 4 and len(answered) >= 2
    assert all(getattr(r, "code", None) is ErrorCode.UNAVAILABLE and "decode_kv_mb" in str(r) for r in refused)
    assert all(len(r.output_token_ids) == 400 for r in answered)
    assert collect(client.stream(chat_inputs({**body, "max_tokens": 3}))).finish_reason == "length"
    client.close()


def test_a_burst_of_long_prompts_waits_for_prefill_s_blocks_and_none_fails(small_pool_server):
    """Prefill's pool (32 blocks) had no admission: six prompts of ~14 blocks each at once
    could exhaust it midway and fail. Now each waits for room and every one is answered (or,
    past queue_timeout_s, refused UNAVAILABLE naming prefill_kv_mb: never another failure)."""
    results: list = []

    def run(index: int) -> None:
        own = GrpcChat(small_pool_server.grpc_url)
        words = " ".join(f"river{index}-{n}" for n in range(70))  # its own blocks: no prefix is shared
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 2, "temperature": 0}
        try:
            results.append(collect(own.stream(chat_inputs(body))))
        except Exception as exc:  # noqa: BLE001 - a refusal is an answer too, checked below
            results.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(results) == 6
    assert all(getattr(r, "code", None) is ErrorCode.UNAVAILABLE and "prefill_kv_mb" in str(r) for r in refused), (
        refused
    )
    assert len(refused) < 6 and all(len(r.prompt_token_ids) > 12 * BLOCK_TOKENS for r in results if r not in refused)


def test_each_stage_instance_names_its_execution_path_in_a_metric(server):
    """pdchat_engine_info{path} = 1 per prefill and decode instance: the tiny Llama runs
    pdchat's own forward (with the C kernels where the stage runs one torch thread)."""
    for model in ("prefill", "decode"):
        assert metric(server, "pdchat_engine_info", model=model, device="cpu", dtype="float32") >= 1
        assert metric(server, "pdchat_engine_info", model=model, path="transformers") == 0
