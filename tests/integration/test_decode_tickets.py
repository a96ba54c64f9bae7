"""Tickets (tensors.DECODE_TICKET): chat routes a request and hands its caller decode's sealed
inputs; the caller streams the answer from decode itself, and it is the answer chat relays.

A ticket is a seal like every other stage input: it opens decode once, for exactly the ids,
params and KV handle chat sealed, within stage_seal_ttl_s.
"""

from __future__ import annotations

import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from pdchat import tensors
from pdchat.clients.chat import ChatError, GrpcChat, chat_inputs, collect
from pdchat.clients.decode_feed import DecodeFeed
from pdchat.core.errors import ErrorCode
from pdchat.core.output.feeds import DecodeFeeds
from tests.conversations import PARITY_CASES, chat_body


def stream_raw(server, model, arrays, parameters=None, outputs=None):
    """Every response (or error) of one request on a gRPC stream, to its final one."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    inputs = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == np.object_ else np_to_triton_dtype(array.dtype)
        entry = grpcclient.InferInput(name, list(array.shape), dtype)
        entry.set_data_from_numpy(array)
        inputs.append(entry)
    requested = None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]
    client.async_stream_infer(
        model, inputs, outputs=requested, parameters=parameters or {}, enable_empty_final_response=True
    )
    responses = []
    try:
        while True:
            result, error = arrived.get(timeout=60)
            responses.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def ticket_and_first(server, body) -> tuple[dict[str, np.ndarray], list[dict]]:
    """chat's answer to `body` asked with a ticket: decode's inputs, by name (its final
    response), and the OpenAI chunks it sent before it (prefill's first output, when prefill
    computed the prompt and the answer streams)."""
    wanted = (*tensors.DECODE_TICKET_OUTPUTS, tensors.RESPONSE)
    *first, (result, error) = stream_raw(server, "chat", chat_inputs(body), {tensors.DECODE_TICKET: True}, wanted)
    assert error is None and all(e is None for _, e in first), error
    ticket = {name: array for name in tensors.DECODE_TICKET_OUTPUTS if (array := result.as_numpy(name)) is not None}
    return ticket, [json.loads(r.as_numpy(tensors.RESPONSE)[0]) for r, _ in first]


def ticket_of(server, body) -> dict[str, np.ndarray]:
    return ticket_and_first(server, body)[0]


def decoded(server, ticket) -> list[dict]:
    """decode's streamed answer to a ticket, as OpenAI chunks."""
    responses = stream_raw(server, "decode", ticket)
    errors = [error for _, error in responses if error is not None]
    if errors:
        raise errors[0]
    return [
        json.loads(result.as_numpy(tensors.RESPONSE)[0]) for result, _ in responses if result.get_response().outputs
    ]


BODY = chat_body("single_turn", max_tokens=6, temperature=0, stream=True)


@pytest.mark.parametrize("prefilled_by", ["decode", "prefill"])
def test_a_ticket_opens_decode_with_the_answer_chat_relays(server, small_pool_server, prefilled_by):
    """An idle decode prefills the prompt itself: its ticket has no KV handle. Prefill's
    KV (small_pool_server's prompts are always prefill's) comes in the ticket's handle."""
    server = server if prefilled_by == "decode" else small_pool_server
    ticket, first = ticket_and_first(server, BODY)
    sealed = {tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS, tensors.STAGE_SEAL}
    # Prefill's first output comes from chat, before the ticket; decode's stream goes on after it.
    from_prefill = {tensors.KV_HANDLE, tensors.FIRST_OUTPUT_SENT}
    assert set(ticket) == (sealed if prefilled_by == "decode" else sealed | from_prefill)
    assert len(first) == (0 if prefilled_by == "decode" else 1)
    chunks = first + decoded(server, ticket)
    relayed = collect(GrpcChat(server.grpc_url).stream(chat_inputs(BODY)))
    assert [c["choices"][0]["delta"].get("content", "") for c in chunks] == [o.text for o in relayed.outputs]
    assert chunks[-1]["choices"][0]["finish_reason"] == relayed.finish_reason == "length"


def test_a_ticket_opens_decode_once(server):
    ticket = ticket_of(server, BODY)
    assert decoded(server, ticket)
    with pytest.raises(Exception, match=r"replayed: this seal opened a stage already"):
        decoded(server, ticket)


def test_a_ticket_opens_decode_for_its_own_ids_only(server):
    ticket = ticket_of(server, BODY)
    other_ids = ticket[tensors.PROMPT_TOKEN_IDS].copy()
    other_ids[-2] = (other_ids[-2] + 1) % 1000
    with pytest.raises(Exception, match=r"refused \(altered: the seal does not match this input\)"):
        decoded(server, {**ticket, tensors.PROMPT_TOKEN_IDS: other_ids})


@pytest.mark.parametrize("part", [tensors.GENERATION_PARAMS, tensors.KV_HANDLE])
def test_a_ticket_opens_decode_for_its_own_params_and_kv_only(small_pool_server, part):
    server = small_pool_server  # its prompts are prefill's: its tickets carry a KV handle
    ticket, other = ticket_of(server, BODY), ticket_of(server, chat_body("single_turn", max_tokens=3, temperature=0))
    assert ticket[part].tobytes() != other[part].tobytes()
    with pytest.raises(Exception, match=r"refused \(altered: the seal does not match this input\)"):
        decoded(server, {**ticket, part: other[part]})
    assert decoded(server, ticket), "a refused alteration leaves the ticket good"
    assert decoded(server, other)


def test_a_ticket_opens_only_the_server_that_issued_it(server, decode_server):
    ticket = ticket_of(server, BODY)
    with pytest.raises(Exception, match=r"refused \(not this server's: sealed by another server"):
        decoded(decode_server, ticket)
    assert decoded(server, ticket)


def test_forwarded_ids_the_gate_refuses_get_no_ticket(decode_server):
    injected = chat_inputs(BODY, prompt_token_ids=[1, 2, 3, 4])
    [(_, error)] = stream_raw(
        decode_server, "chat", injected, {tensors.DECODE_TICKET: True}, tensors.DECODE_TICKET_OUTPUTS
    )
    assert error is not None and "forwarded prompt token ids refused (unsigned)" in error.message()


def test_a_ticket_request_that_is_no_bool_is_refused_naming_it(server):
    [(_, error)] = stream_raw(server, "chat", chat_inputs(BODY), {tensors.DECODE_TICKET: "yes"})
    assert error is not None and f"request parameter '{tensors.DECODE_TICKET}' must be a bool" in error.message()


def answers(server, body, form=tensors.REQUEST):
    """What a front reads of one answer, relayed by chat and streamed from decode directly."""
    seen = []
    for direct in (False, True):
        client = GrpcChat(server.grpc_url, outputs=tensors.FRONT_OUTPUTS, decode_direct=direct)
        result = collect(client.stream(chat_inputs(body, form=form)))
        seen.append([(o.response.get("choices"), o.finish_reason, o.prompt_token_ids) for o in result.outputs])
    return seen


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("case", ["tool_required", "json_schema", "reasoning_open", "stop_strings"])
def test_direct_streams_answer_as_relayed_ones(server, case, stream):
    """decode_direct changes where the answer comes from, not what it says."""
    body = {**PARITY_CASES[case], "max_tokens": 24, "temperature": 0, "stream": stream}
    relayed, direct = answers(server, body)
    assert relayed == direct and relayed[-1][1]


def test_direct_completions_answer_as_relayed_ones(server):
    relayed, direct = answers(
        server, {"prompt": "Once upon", "max_tokens": 8, "temperature": 0}, tensors.COMPLETION_REQUEST
    )
    assert relayed == direct and relayed[-1][1] == "length"


def test_a_refusal_of_chat_reaches_a_direct_client_as_chat_s_error(server):
    client = GrpcChat(server.grpc_url, decode_direct=True)
    with pytest.raises(ChatError) as info:
        collect(client.stream(chat_inputs({**BODY, "max_tokens": 10**6})))
    assert info.value.code is ErrorCode.INVALID_ARG and "max_tokens" in str(info.value)


def front_answer(server, body, fed):
    """What a front reads of one answer: streamed from decode through its feed (`fed`), or
    relayed by chat (the reference)."""
    client = GrpcChat(server.grpc_url, outputs=tensors.FRONT_OUTPUTS, decode_direct=fed)
    assert client.decode_feed is fed
    return [(o.response.get("choices"), o.finish_reason) for o in collect(client.stream(chat_inputs(body))).outputs]


def test_concurrent_answers_share_the_feed_each_getting_its_own(server):
    bodies = [chat_body("single_turn", max_tokens=8 + i, temperature=0, stream=True) for i in range(6)]
    alone = [front_answer(server, body, fed=False) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: front_answer(server, body, fed=True), bodies))
    assert together == alone


def test_a_feed_that_ends_mid_answer_loses_no_output_silently_then_a_new_one_serves(server):
    """The feed's connection breaks mid-answer: the answer either fails Unavailable naming the
    feed (outputs decode sent through it were lost) or, where decode noticed before sending
    any more through it, streams the rest unfed and equals the unfed answer; never a short one."""
    body = chat_body("single_turn", max_tokens=400, temperature=0, stream=True)
    unfed = front_answer(server, body, fed=False)
    client = GrpcChat(server.grpc_url, outputs=tensors.FRONT_OUTPUTS, decode_direct=True)
    outputs = client.stream(chat_inputs(body))
    first = next(outputs)
    feed = DecodeFeed.current(server.grpc_url)
    assert feed is not None
    feed._call.cancel()  # as when the connection under it breaks
    try:
        rest = collect(outputs).outputs
    except ChatError as error:
        assert error.code is ErrorCode.UNAVAILABLE and "decode feed" in str(error)
    else:
        assert [(o.response.get("choices"), o.finish_reason) for o in [first, *rest]] == unfed
    time.sleep(DecodeFeed.RETRY_S)
    body = chat_body("single_turn", max_tokens=6, temperature=0, stream=True)
    assert front_answer(server, body, fed=True) == front_answer(server, body, fed=False)
    assert DecodeFeed.current(server.grpc_url) not in (None, feed)


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({tensors.DECODE_FEED_OPEN: ""}, tensors.DECODE_FEED_OPEN),
        ({tensors.DECODE_FEED: "x"}, tensors.DECODE_FEED_KEY),
        ({tensors.DECODE_FEED: "x" * 129, tensors.DECODE_FEED_KEY: "k"}, tensors.DECODE_FEED),
    ],
)
def test_bad_feed_parameters_are_refused_naming_them(server, parameters, named):
    ticket = ticket_of(server, chat_body("single_turn", max_tokens=4, temperature=0, stream=True))
    [(_, error)] = stream_raw(server, "decode", ticket, parameters)
    assert error is not None and f"'{named}'" in error.message()


def feed_grant(server, feed_id: str) -> str:
    """The grant chat answers a ticket request with, for decode's feed `feed_id`."""
    body = chat_body("single_turn", max_tokens=2, temperature=0, stream=True)
    parameters = {tensors.DECODE_TICKET: True, tensors.DECODE_FEED_GRANT: feed_id}
    *_, (result, error) = stream_raw(server, "chat", chat_inputs(body), parameters, [tensors.FEED_SEAL])
    assert error is None, error
    return result.as_numpy(tensors.FEED_SEAL)[0].decode()


def open_feeds(server, grants: dict[str, str]):
    """Open decode's feeds `grants` (id -> grant) on one gRPC stream; their responses (or
    errors) go to the queue returned, with the client that holds them."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    for feed_id, grant in grants.items():
        seal = grpcclient.InferInput(tensors.STAGE_SEAL, [1], "BYTES")
        seal.set_data_from_numpy(np.array([grant.encode()], dtype=np.object_))
        client.async_stream_infer(
            "decode", [seal], parameters={tensors.DECODE_FEED_OPEN: feed_id}, enable_empty_final_response=True
        )
    return client, arrived


def closing(client) -> None:
    client.stop_stream(cancel_requests=True)
    client.close()


@pytest.mark.parametrize(
    ("grant", "refusal"),
    [
        (lambda server: "", "malformed"),  # the red team's: an empty stage_seal
        (lambda server: feed_grant(server, "another-feed"), "altered"),  # a grant of another feed
        (lambda server: "0" * 12 + ".1." + "0" * 32 + "." + "0" * 64, "not this server's"),
    ],
    ids=["empty", "other-feed", "forged"],
)
def test_a_feed_opens_only_with_chat_s_grant_for_it(server, grant, refusal):
    client, arrived = open_feeds(server, {"feed-x": grant(server)})
    try:
        _, error = arrived.get(timeout=30)
        assert error is not None and "a decode feed refused" in error.message() and f"({refusal}" in error.message()
    finally:
        closing(client)


def test_a_grant_opens_one_feed_once(server):
    grant = feed_grant(server, "feed-once")
    client, arrived = open_feeds(server, {"feed-once": grant})
    try:
        again, again_arrived = open_feeds(server, {"feed-once": grant})
        _, error = again_arrived.get(timeout=30)
        closing(again)
        assert error is not None and "(replayed" in error.message()
        assert arrived.empty()  # the first stays open
    finally:
        closing(client)


def test_idle_feeds_held_by_another_caller_keep_no_front_s_feed_out(server):
    """The red team held decode's 64 feeds and every answer through the fronts failed. Now
    each needs a grant, and a front's feed takes the place of an idle one: the front's
    answers are fed and right, and one held feed is closed."""
    grants = {f"held-{index}": feed_grant(server, f"held-{index}") for index in range(DecodeFeeds.MAX_FEEDS)}
    client, arrived = open_feeds(server, grants)
    try:
        time.sleep(1)
        assert arrived.empty()  # all 64 held, none refused
        body = chat_body("single_turn", max_tokens=6, temperature=0, stream=True)
        time.sleep(DecodeFeed.RETRY_S)  # past an earlier test's feed end
        assert front_answer(server, body, fed=True) == front_answer(server, body, fed=False)
        feed = DecodeFeed.current(server.grpc_url)
        assert feed is not None and not feed.ended  # the front's own feed was opened
        result, error = arrived.get(timeout=30)  # the idle feed whose place it took ended
        assert error is None and result.get_response().parameters["triton_final_response"].bool_param
    finally:
        closing(client)
