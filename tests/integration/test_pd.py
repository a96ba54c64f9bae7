"""Disaggregated serving: prefill server + decode server + router, real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from benchmarks import load
from pdchat.clients.chat import GrpcChat, chat_inputs, collect
from pdchat.core.kv.shm import SHM_PREFIX, ShmConnector, expired_files, kv_directory
from pdchat.ensemble.seal import server_directory
from pdchat.launcher import PDStack
from tests.conversations import PARITY_CASES, PICK_TOOL, SAMPLING_CASES
from tests.integration import soak
from tests.integration.conftest import TEST_POOLS, in_background
from tests.integration.helpers import (
    StreamReader,
    answers_of,
    blocking,
    chat_renders,
    executions,
    metric,
    post,
    responses,
    router_answer,
    router_responses,
    wait_for,
)
from tests.logprobs import assert_logprobs_close, logprobs_of

KV_TTL_S = 6.0  # short for the expiry tests, long enough for a pull on a loaded machine
STALL_S = 3.0  # the router's deadlines in the fault tests (restarted_router)
DRAIN_S = 8.0
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
ENDLESS = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 3000, "ignore_eos": True}
CASES = [
    "single_turn",
    "multi_turn",
    "unicode_emoji",
    "tool_result",
    "tool_required",
    "reasoning_open",
    "json_schema",
    "long_prompt",
]


@pytest.fixture(scope="module", params=["shm", "nixl"])
def stack(request, tmp_path_factory, tiny_model_dir):
    instance = PDStack(
        model="tiny",
        connector=request.param,
        # Every prompt pass takes the cores in turns (not only those of 40 ms or more on this
        # host): the pair runs its tests so, and test_a_pd_pair_on_one_host_takes_turns_on_its_cores
        # holds on any host.
        env={"PDCHAT_KV_TTL_S": str(KV_TTL_S), "PDCHAT_PREFILL_TAKES_CORES_MS": "1", **TEST_POOLS},
        log_dir=tmp_path_factory.mktemp(f"pd-logs-{request.param}"),
    )
    instance.start()
    yield instance
    instance.stop()  # before the next stack starts: two pairs at once are a lot of memory
    for server in (instance.prefill, instance.decode):
        assert server.leaked_shm() == []

    def expire() -> None:  # in the background, while the next tests run; checked at the session's end
        # What the killed prefill server left is freed by the next pdchat process's sweep (other
        # servers' live KV may share the directory: what matters is that nothing expired stays).
        time.sleep(KV_TTL_S + 0.5)
        ShmConnector().sweep()
        assert expired_files() == [], f"expired KV left in shared memory after the {request.param} stack"

    in_background(expire)


def shm_kv() -> list[Path]:
    return sorted(kv_directory().glob(f"{SHM_PREFIX}*"))


def held_kv(stack) -> float:
    """KV the prefill server still holds, once its sweeper has seen the pulls (checked, not assumed)."""

    def held() -> float:
        return metric(stack.prefill, "pdchat_kv_held_bytes") + sum(p.stat().st_size for p in shm_kv())

    wait_for(lambda: held() == 0, timeout=5)  # the sweeper runs every second
    return held()


def router_health(stack) -> dict:
    return router_readiness(stack)[1]


def router_readiness(stack) -> tuple[int, dict]:
    """The router's /health: its status and body (the same body with 503, while not ready)."""
    try:
        reply = urllib.request.urlopen(f"{stack.router_url}/health", timeout=30)
    except urllib.error.HTTPError as exc:
        reply = exc
    return reply.status, json.loads(reply.read())


@pytest.fixture(scope="module")
def monolithic_answers(server):
    """The same requests on a monolithic server (chat, render path)."""
    client = GrpcChat(server.grpc_url, "chat")
    answers = {}
    for case in CASES:
        body = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, **PARITY_CASES[case]}
        answers[case] = collect(client.stream(chat_inputs(body)))
    client.close()
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", CASES)
def test_pd_answers_equal_monolithic_token_for_token(stack, monolithic_answers, case, stream):
    body = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, "stream": stream, **PARITY_CASES[case]}
    pulled = metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled")
    answer = router_answer(stack, body)
    assert metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 1, (
        "decode did not use prefill's KV"
    )
    expected = monolithic_answers[case]
    assert answer["ids"] == expected.output_token_ids
    message = expected.outputs[-1].response["choices"][0].get("message")
    if message is not None:
        assert answer["content"] == (message["content"] or "")
        assert answer["reasoning"] == (message.get("reasoning_content") or "")
    assert answer["finish_reason"] == expected.finish_reason


def test_a_streamed_pd_answer_is_one_response_chunk_for_chunk_as_monolithic(stack, server):
    """The prefill leg's first output reaches the client before the decode leg starts; the
    decode leg goes on from the second as the same response (id and created)."""
    body = {"max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True, **PARITY_CASES["multi_turn"]}
    chunks = router_responses(stack, body)
    client = GrpcChat(server.grpc_url, "chat")
    monolithic = responses(collect(client.stream(chat_inputs(body))))
    client.close()
    assert len({(chunk["id"], chunk["created"]) for chunk in chunks}) == 1

    def without_identity(answer):
        return [{k: v for k, v in chunk.items() if k not in ("id", "created")} for chunk in answer]

    assert without_identity(chunks) == without_identity(monolithic)


@pytest.fixture(scope="module")
def monolithic_sampling(server):
    """The sampling cases on a monolithic server (chat, render path), whole and streamed."""
    client = GrpcChat(server.grpc_url, "chat")
    yield {
        stream: answers_of(
            client,
            {name: {**body, "stream": stream, "return_token_ids": True} for name, body in SAMPLING_CASES.items()},
        )
        for stream in (False, True)
    }
    client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_pd_sampling_fields_and_logprobs_equal_monolithic(stack, monolithic_sampling, case, stream):
    """Penalties, biases, limits, seeded sampling and logprobs through the router: the first
    token's logprobs travel from the prefill server inside the signed KV handle."""
    pulled = metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled")
    answer = router_responses(stack, {**SAMPLING_CASES[case], "stream": stream, "return_token_ids": True})
    assert metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 1, (
        "decode did not use prefill's KV"
    )
    expected = monolithic_sampling[stream][case]
    assert [t for a in answer for c in a["choices"] for t in c.get("token_ids") or []] == expected.output_token_ids
    assert_logprobs_close(logprobs_of(answer), logprobs_of(responses(expected)))


def test_openai_client_gets_top_logprobs_through_the_router(stack, monolithic_sampling):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    body = SAMPLING_CASES["greedy_logprobs"]
    expected = logprobs_of(responses(monolithic_sampling[False]["greedy_logprobs"]))
    whole = client.chat.completions.create(model=model, **body).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(model=model, stream=True, **body)
        for entry in chunk.choices[0].logprobs.content
    ]
    for entries in (whole, streamed):
        assert all(len(entry.top_logprobs) == body["top_logprobs"] for entry in entries)
        assert_logprobs_close([entry.model_dump() for entry in entries], expected)


def test_decode_never_renders_and_prefill_never_decodes(stack):
    before = chat_renders(stack.decode), executions(stack.prefill, "decode")
    pulled = metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled")
    for case in ("single_turn", "long_prompt"):
        router_answer(stack, {"max_tokens": 4, "temperature": 0, **PARITY_CASES[case]})
    assert (chat_renders(stack.decode), executions(stack.prefill, "decode")) == before
    assert metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 2
    assert held_kv(stack) == 0


def test_a_pd_pair_on_one_host_takes_turns_on_its_cores(stack):
    """The prefill server marks its passes for the decode server beside it (the decode
    server's decode waits for marks and is in use), so that decode steps between them
    instead of beside them: prefill_takes_cores_ms across the host's servers
    (pdchat.ensemble.core_turns). NOTE: the prefill server's own decode, never used, gives
    it nothing to mark for: a mark here is the decode server's."""
    decode_directory = server_directory(stack.decode.process.pid, create=False)
    prefill_directory = server_directory(stack.prefill.process.pid, create=False)
    assert list(decode_directory.glob("decode-turns.*")), "the decode server's decode waits for marks"

    def marked() -> int:
        return sum(struct.unpack_from("<q", path.read_bytes())[0] for path in prefill_directory.glob("prefill-pass.*"))

    before = marked()
    for turn in range(3):  # new prompts (no cached prefix); the first pass of a stack has no rate measured yet
        prompt = {"messages": [{"role": "user", "content": f"{turn} Summarize: " + "the quick brown fox " * 200}]}
        router_answer(stack, {"max_tokens": 2, "temperature": 0, **prompt})
    assert marked() > before, "no pass of the prefill server was marked for the decode server"


def test_openai_client_streams_a_tool_call_through_the_router(stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick a number"}],
        tools=[PICK_TOOL],
        tool_choice="required",
        max_tokens=96,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls, finish, usage = [], None, []
    for chunk in stream:
        if not chunk.choices:  # the usage chunk, last
            usage.append(chunk.usage)
            continue
        assert chunk.usage is None
        calls += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert len(usage) == 1 and usage[0].completion_tokens > 0 and usage[0].prompt_tokens > 0
    assert [c.function.name for c in calls] == ["pick_number"]
    assert set(json.loads(calls[0].function.arguments)) == {"n", "ok"}


def test_a_vllm_style_proxy_sending_json_only_gets_the_monolithic_answer(stack, monolithic_answers):
    """As vLLM's disaggregation proxy drives a pair: kv_transfer_params inside the JSON, the
    prefill answer's kv_transfer_params (ids listed) copied into the decode request."""
    body = {"max_tokens": 12, "temperature": 0, **PARITY_CASES["multi_turn"]}
    prefill, decode = GrpcChat(stack.prefill.grpc_url), GrpcChat(stack.decode.grpc_url)
    try:
        [answer] = list(
            prefill.stream(chat_inputs({**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}))
        )
        params = answer.response["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["prompt_token_ids"] == answer.prompt_token_ids
        renders = chat_renders(stack.decode)
        result = collect(decode.stream(chat_inputs({**body, "kv_transfer_params": params})))
    finally:
        prefill.close()
        decode.close()
    assert result.output_token_ids == monolithic_answers["multi_turn"].output_token_ids
    assert chat_renders(stack.decode) == renders


def test_unknown_fields_and_client_kv_transfer_params_are_400s_from_the_router(stack):
    for fields, needle in [
        ({"functions": []}, "Unrecognized request argument supplied: functions"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params is the router's to set"),
        ({"prompt_token_ids": [1, 2, 3]}, "prompt_token_ids is the router's to set"),
    ]:
        with pytest.raises(urllib.error.HTTPError) as info:
            post(stack, {"messages": [{"role": "user", "content": "x"}], **fields})
        assert info.value.code == 400 and needle in json.loads(info.value.read())["error"]["message"]


def test_bad_request_through_the_router_is_a_400_with_the_reason(stack):
    with pytest.raises(urllib.error.HTTPError) as info:
        post(stack, {"messages": [{"role": "wizard", "content": "x"}]})
    assert info.value.code == 400
    assert "messages[0].role is 'wizard'" in json.loads(info.value.read())["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "status", "needle"),
    [
        ({"max_tokens": 10**12}, 400, "does not fit"),
        ({"model": "no-such-model"}, 404, "is not served here"),  # model_not_found, as OpenAI
        (
            {"continue_final_message": True},
            400,
            "continue_final_message needs the last message to be from the assistant",
        ),
        ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, 400, "may not set 'chat_template'"),
    ],
)
def test_errors_raised_at_render_on_prefill_stay_client_errors(stack, fields, status, needle):
    """Caught only by the prefill server's renderer: a 400 (404 for the model) with its
    message, not a fallback."""
    fallbacks = router_health(stack)["stats"]["prefill_fallbacks"]
    with pytest.raises(urllib.error.HTTPError) as info:
        post(stack, {"messages": [{"role": "user", "content": "hi"}], **fields})
    assert info.value.code == status
    error = json.loads(info.value.read())["error"]
    message = error["message"]
    assert needle in message and not message.startswith("[")
    assert (error["code"] == "model_not_found") == (status == 404)
    assert router_health(stack)["stats"]["prefill_fallbacks"] == fallbacks


def test_request_id_reaches_both_servers_logs(stack):
    request_id = "trace-me-7f3a"
    router_answer_with_id = post(
        stack, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, {"X-Request-Id": request_id}
    )
    assert router_answer_with_id.headers["X-Request-Id"] == request_id
    router_answer_with_id.read()
    for server in (stack.prefill, stack.decode):
        assert f"chat request {request_id}" in server.log_path.read_text()


def test_expired_kv_is_recomputed_from_the_ids_without_rendering(stack):
    body = {"max_tokens": 8, "temperature": 0, **PARITY_CASES["multi_turn"]}
    prefill, decode = GrpcChat(stack.prefill.grpc_url), GrpcChat(stack.decode.grpc_url)
    [handed] = list(prefill.stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
    assert wait_for(lambda: metric(stack.prefill, "pdchat_kv_held_bytes") > 0, timeout=5)
    assert wait_for(
        lambda: metric(stack.prefill, "pdchat_kv_held_bytes") == 0, timeout=KV_TTL_S + 5
    )  # its sweeper freed it
    assert held_kv(stack) == 0
    renders = chat_renders(stack.decode)
    recomputed = metric(stack.decode, "pdchat_kv_pulls_total", outcome="recomputed")
    result = collect(
        decode.stream(
            chat_inputs(body, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params)
        )
    )
    assert result.output_token_ids == collect(decode.stream(chat_inputs(body))).output_token_ids
    assert chat_renders(stack.decode) == renders + 1  # only the comparison rendered
    assert metric(stack.decode, "pdchat_kv_pulls_total", outcome="recomputed") == recomputed + 1
    prefill.close()
    decode.close()


def test_client_leaving_the_router_stream_cancels_decode(stack):
    cancelled = metric(stack.decode, "pdchat_decode_requests_total", outcome="cancelled")
    reply = post(
        stack,
        {
            "messages": [{"role": "user", "content": "Go on forever"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        },
    )
    for _ in range(4):
        reply.readline()
    reply.close()
    assert wait_for(lambda: metric(stack.decode, "pdchat_decode_active") == 0)
    assert metric(stack.decode, "pdchat_decode_requests_total", outcome="cancelled") == cancelled + 1
    assert held_kv(stack) == 0


def test_router_restart_keeps_serving(stack, tmp_path):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    before = router_answer(stack, body)
    stack.stop_router()
    stack.start_router(tmp_path / "router-restarted.log")
    assert router_answer(stack, body) == before


def test_a_pd_request_is_parsed_once_per_process_and_the_handoff_forwarded_as_sent(stack, monkeypatch):
    from pdchat.clients.router import PDRouter

    def parsed(server, model, form):
        return metric(server, "pdchat_requests_parsed_total", model=model, form=form)

    counted = [
        (stack.prefill, "chat", "request"),
        (stack.prefill, "renderer", "chat_request"),
        (stack.prefill, "renderer", "request"),
        (stack.decode, "chat", "request"),
        (stack.decode, "renderer", "chat_request"),
    ]
    before = [parsed(*where) for where in counted]
    router = PDRouter([stack.prefill.grpc_url], [stack.decode.grpc_url])
    decodes, real_loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda *args, **kw: (decodes.append(args[0]), real_loads(*args, **kw))[1])
    body = {"max_tokens": 4, "temperature": 0, "stream": True, **PARITY_CASES["tool_result"]}
    outputs = [list(blocking(router.chat(body))) for _ in range(2)]
    monkeypatch.undo()
    # (A tool call's arguments inside a message are JSON in JSON: validating them parses them.)
    forwarded = [d for d in decodes if any(key in str(d) for key in ('"messages"', "chat.completion", '"signature"'))]
    assert forwarded == [], "the router re-parsed JSON it forwards"
    assert all(o[-1].finish_reason for o in outputs) and router.stats.disaggregated == 2
    # chat parses the client's JSON and renders it (a short request); no renderer parses it again.
    assert [parsed(*where) for where in counted] == [b + d for b, d in zip(before, [2, 0, 0, 2, 0], strict=True)]


def test_the_baseline_mode_renders_on_decode_and_gives_the_reuse_answer(stack, monolithic_answers):
    """The benchmarks' comparison (vLLM before forwarded ids): decode renders, then uses the KV."""
    from pdchat.clients.router import PDRouter

    body = {"max_tokens": 12, "temperature": 0, **PARITY_CASES["tool_result"]}
    answers = {}
    for forward_ids in (True, False):
        router = PDRouter([stack.prefill.grpc_url], [stack.decode.grpc_url], forward_ids=forward_ids)
        renders = chat_renders(stack.decode)
        pulled = metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled")
        answers[forward_ids] = collect(blocking(router.chat(body)))
        assert chat_renders(stack.decode) == renders + (0 if forward_ids else 1)
        assert (
            metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 1
        )  # the transferred KV, both ways
    assert (
        answers[False].output_token_ids
        == answers[True].output_token_ids
        == monolithic_answers["tool_result"].output_token_ids
    )


def test_pd_pair_soaks_through_the_router(stack):
    """tests/integration/soak.py's soak through the router, then no KV left: every KV was
    pulled, or expired after its TTL. On the shm stack (its KV files are counted), before
    the fault tests."""
    if stack.connector != "shm":
        pytest.skip("the soak counts the shm connector's KV files")
    engine = soak.kv_engine(stack)
    send = load.RouterStreams(stack.router_url)
    soak.soak(send, [stack.prefill, stack.decode], stack.decode, abandon_cancels=True)
    assert wait_for(lambda: metric(stack.prefill, "pdchat_kv_held_bytes") == 0, timeout=KV_TTL_S + 5)
    # Handed-back files expire one KV TTL after their pull, and the sweeper frees them.
    assert wait_for(lambda: not list(kv_directory().glob(f"*pdchat_kv*_{engine}_*")), timeout=KV_TTL_S + 6.5), (
        "KV files left in shared memory"
    )


@pytest.fixture(scope="module")
def restart_router(stack, tmp_path_factory):
    """The stack's router restarted with the deadlines STALL_S and DRAIN_S; calling it
    restarts it again, with them or (`short=False`) with the defaults, which the last fault
    test restores for the tests after. Only on the shm stack: the deadlines are the
    router's, whatever the connector."""
    if stack.connector != "shm":
        pytest.skip("the router's deadlines do not depend on the connector")
    logs = tmp_path_factory.mktemp("router-deadlines")

    def restart(short: bool = True) -> None:
        stack.stop_router()
        with pytest.MonkeyPatch.context() as patch:
            if short:  # the router process inherits them
                patch.setenv("PDCHAT_STALL_TIMEOUT_S", str(STALL_S))
                patch.setenv("PDCHAT_DRAIN_TIMEOUT_S", str(DRAIN_S))
            stack.start_router(logs / f"router-{time.monotonic_ns()}.log")

    restart()
    return restart


def refusal(stack) -> tuple[int, str, float, str]:
    """(status, error code, seconds taken, message) of a request the router refuses."""
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as info:
        post(stack, SHORT)
    error = json.loads(info.value.read())["error"]
    return info.value.code, error["code"], time.monotonic() - started, error["message"]


def serves(stack) -> bool:
    try:
        return router_answer(stack, SHORT)["finish_reason"] is not None
    except urllib.error.HTTPError:
        return False


@pytest.mark.faults
def test_a_stopped_decode_server_ends_streams_at_the_stall_deadline_and_gets_no_requests_until_it_continues(
    stack, restart_router
):
    decode = stack.decode
    cancelled = metric(decode, "pdchat_decode_requests_total", outcome="cancelled")
    streams = [StreamReader(stack.router_url, ENDLESS) for _ in range(3)]
    assert all(s.first.wait(60) for s in streams) and all(s.status == 200 for s in streams)
    # The first chunk comes from the prefill leg: decode runs the three once it counts them.
    assert wait_for(lambda: metric(decode, "pdchat_decode_active") == 3)
    os.killpg(decode.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        for stream in streams:
            stream.join(STALL_S + 10)
            assert stream.ended_at - stopped < STALL_S + 5
            *_, error, done = stream.events
            assert done == "[DONE]" and error["error"]["type"] == "upstream_timeout", error
            assert f"decode server {decode.grpc_url} sent nothing for 3 s" in error["error"]["message"]
        for _ in range(3):  # for as long as it is stopped
            status, code, took, message = refusal(stack)
            assert (status, code) == (503, "UNAVAILABLE") and took < 2.0
            assert f"no decode server is ready ({decode.grpc_url})" in message
            time.sleep(1)
    finally:
        os.killpg(decode.process.pid, signal.SIGCONT)
    assert wait_for(lambda: serves(stack), timeout=30), "the stack did not serve again after SIGCONT"
    assert wait_for(lambda: metric(decode, "pdchat_decode_requests_total", outcome="cancelled") == cancelled + 3)
    assert wait_for(lambda: metric(decode, "pdchat_decode_active") == 0)


@pytest.mark.faults
def test_a_stopped_prefill_server_costs_one_stall_then_decode_serves_whole(stack, restart_router):
    prefill = stack.prefill
    stats = router_health(stack)["stats"]
    os.killpg(prefill.process.pid, signal.SIGSTOP)
    try:
        timings = []
        for _ in range(2):
            started = time.monotonic()
            assert router_answer(stack, SHORT)["finish_reason"] is not None
            timings.append(time.monotonic() - started)
    finally:
        os.killpg(prefill.process.pid, signal.SIGCONT)
    assert STALL_S <= timings[0] < STALL_S + 5, "the stalled prefill leg"
    assert timings[1] < STALL_S, "the next request waited for the stopped prefill server"
    assert wait_for(lambda: router_health(stack)["prefill"][prefill.grpc_url], timeout=30)
    assert router_answer(stack, SHORT)["finish_reason"] is not None
    after = router_health(stack)["stats"]
    assert after["prefill_fallbacks"] == stats["prefill_fallbacks"] + 2
    assert after["disaggregated"] == stats["disaggregated"] + 1, "prefill did not come back"


@pytest.mark.faults
def test_a_whole_answer_longer_than_the_stall_deadline_still_arrives(stack, restart_router):
    """Nothing of a whole answer comes before its end: decode's heartbeats, relayed by chat,
    keep the router's wait for the next response under STALL_S."""
    # 6,000 tokens: over 2 x STALL_S below 1,000 tokens/s for one stream (a 2-core host does ~300).
    body = {**ENDLESS, "max_tokens": 6000, "stream": False}
    started = time.monotonic()
    [answer] = router_responses(stack, body)
    took = time.monotonic() - started
    assert answer["usage"]["completion_tokens"] == 6000 and answer["choices"][0]["finish_reason"] == "length"
    assert took > 2 * STALL_S, f"the answer took {took:.1f} s: too short to show the deadline was kept"


@pytest.mark.faults
def test_sigterm_drains_the_router_then_it_exits(stack, restart_router):
    short = StreamReader(stack.router_url, {**SHORT, "max_tokens": 16})
    endless = StreamReader(stack.router_url, ENDLESS)
    assert short.first.wait(60) and endless.first.wait(60)
    stack.router.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert wait_for(lambda: router_readiness(stack)[0] == 503, timeout=1, interval=0.05), "readiness stayed true"
    assert router_health(stack)["draining"] is True
    status, code, took, _ = refusal(stack)
    assert (status, code) == (503, "draining") and took < 2.0
    short.join(DRAIN_S)
    assert short.events[-1] == "[DONE]" and short.events[-2]["choices"][0]["finish_reason"] == "length"
    endless.join(DRAIN_S + 10)
    *_, error, done = endless.events
    assert done == "[DONE]" and error["error"]["code"] == "draining", error
    assert DRAIN_S <= endless.ended_at - signalled < DRAIN_S + 3
    assert stack.router.wait(10) == 0
    assert wait_for(lambda: metric(stack.decode, "pdchat_decode_active") == 0), "decode kept the ended stream"
    restart_router()


@pytest.mark.faults
def test_post_drain_from_this_host_drains_then_stops_the_router(stack, restart_router):
    """The red team's unauthenticated POST /drain left the router up answering 503 for good;
    now it needs the API key or a client on this host, and a drained router exits (0), for
    its supervisor to start it again."""
    drain = urllib.request.Request(f"{stack.router_url}/drain", data=b"", method="POST")
    with urllib.request.urlopen(drain, timeout=30) as reply:
        assert json.loads(reply.read()) == {"drained": True}
    assert stack.router.wait(15) == 0, "the drained router did not exit"
    restart_router(short=False)


@pytest.mark.faults
def test_prefill_dying_then_dead_falls_back_to_decode_alone_and_decode_dead_is_a_503(stack, monolithic_answers):
    """Last: it kills both servers. Requests run whole on decode, with the same answers."""
    import threading

    body = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, **PARITY_CASES["long_prompt"]}
    requests = router_health(stack)["stats"]["requests"]
    # Frozen first, so the request is certainly in flight on the prefill server when it dies.
    os.killpg(stack.prefill.process.pid, signal.SIGSTOP)
    answers = []
    during = threading.Thread(target=lambda: answers.append(router_answer(stack, body)))
    during.start()
    assert wait_for(lambda: router_health(stack)["stats"]["requests"] == requests + 1)
    os.killpg(stack.prefill.process.pid, signal.SIGKILL)
    stack.prefill.process.wait()
    during.join(120)
    assert answers and answers[0]["ids"] == monolithic_answers["long_prompt"].output_token_ids
    stack.prefill.cleanup_shm()

    after = router_answer(stack, {**body, **PARITY_CASES["multi_turn"]})
    assert after["ids"] == monolithic_answers["multi_turn"].output_token_ids
    health = router_health(stack)
    assert health["ok"] and not any(health["prefill"].values())
    assert health["stats"]["prefill_fallbacks"] >= 2

    stack.decode.stop()
    for needle in (f"decode server {stack.decode.grpc_url} is unavailable", "no decode server is ready"):
        status, code, took, message = refusal(stack)
        assert (status, code) == (503, "UNAVAILABLE") and took < 2.0 and needle in message
