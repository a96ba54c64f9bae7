"""GPT-OSS on real servers: the Harmony render path, forwarded-id reuse, P/D through the router.

One P/D pair on `tiny-gptoss` (prefill server, decode server, router). The decode server's
`chat` serves the render path (renderer -> prefill -> decode in one server: monolithic
serving) and the reuse path (ids forwarded from the prefill server), so both paths are
compared on one server, and the router's P/D answer against the render path.
"""

from __future__ import annotations

import pytest

from pdchat.launcher import PDStack
from tests.conversations import WEATHER_TOOL as WEATHER
from tests.integration.adversarial import ADVERSARIAL
from tests.integration.conftest import TEST_POOLS, in_background
from tests.integration.helpers import (
    ask,
    chat_renders,
    forwarded,
    metric,
    pd_clients,
    prefill_leg,
    refusal,
    router_answer,
    summary,
)

DATE = "2026-11-30"
ASKED = {"role": "user", "content": "What is the weather in Paris?"}
CASES = {
    "instructions": {"messages": [{"role": "system", "content": "Answer briefly."}, ASKED], "reasoning_effort": "high"},
    "tools": {"messages": [ASKED], "tools": [WEATHER]},
    "tool_result_after_reasoning": {
        "messages": [
            ASKED,
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Look it up.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        ],
        "tools": [WEATHER],
        "reasoning_effort": "low",
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    instance = PDStack(
        model="tiny-gptoss",
        env={"PDCHAT_CURRENT_DATE": DATE, **TEST_POOLS},
        log_dir=tmp_path_factory.mktemp("harmony-logs"),
    )
    instance.start()
    yield instance

    def stop() -> None:  # in the background, while the next tests run; checked at the session's end
        instance.stop()
        for server in (instance.prefill, instance.decode):
            assert server.leaked_shm() == [], f"the gpt-oss {server.role} server left shm regions"

    in_background(stop)


@pytest.fixture(scope="module")
def clients(stack):
    with pd_clients(stack) as made:
        yield made


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_and_reuse_paths_give_identical_answers(stack, clients, case):
    body = {"max_tokens": 12, "temperature": 0, **CASES[case]}
    seen = []
    for protocol in ("grpc", "http"):
        for stream in (False, True):
            request = {**body, "stream": stream}
            handed = prefill_leg(clients, body)
            renders = chat_renders(stack.decode)
            reused = ask(clients[protocol], request, **forwarded(handed))
            assert chat_renders(stack.decode) == renders, "the reuse path ran the renderer"
            rendered = ask(clients[protocol], request)
            assert chat_renders(stack.decode) == renders + 1
            assert reused.prompt_token_ids == rendered.prompt_token_ids == handed.prompt_token_ids
            assert summary(reused) == summary(rendered), (protocol, stream)
            seen.append(summary(rendered))
    assert all(s == seen[0] for s in seen), "transport or streaming changed the answer"
    assert seen[0]["ids"][0] == handed.output_token_ids[0], "prefill's first token starts the answer"
    assert seen[0]["finish_reason"] == "length" and seen[0]["content"], (
        "the gibberish model's text comes back as content"
    )


def test_the_prompt_is_harmony_with_the_servers_date(stack, clients):
    from transformers import AutoTokenizer

    from pdchat import embedded, registry

    tokenizer = AutoTokenizer.from_pretrained(embedded.ensure_model(registry.TINY_GPTOSS))
    ids = ask(clients["grpc"], {"max_tokens": 1, **CASES["tools"]}).prompt_token_ids
    text = tokenizer.decode(ids)
    assert text.startswith("<|start|>system<|message|>") and f"Current date: {DATE}" in text
    assert "namespace functions" in text and text.endswith("<|start|>assistant")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pd_through_the_router_equals_monolithic(stack, clients, case, stream):
    body = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, "stream": stream, **CASES[case]}
    expected = summary(ask(clients["grpc"], body))
    pulled = metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled")
    renders = chat_renders(stack.decode)
    answer = router_answer(stack, body)
    assert metric(stack.decode, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 1, (
        "decode did not use prefill's KV"
    )
    assert chat_renders(stack.decode) == renders, "decode rendered the prompt again"
    assert answer["ids"] == expected["ids"]
    assert (answer["content"], answer["reasoning"], answer["tool_calls"], answer["finish_reason"]) == (
        expected["content"],
        expected["reasoning"],
        expected["tool_calls"],
        expected["finish_reason"],
    )


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_the_gate_refuses_what_it_refuses_on_the_template_path(stack, clients, case):
    body = {"max_tokens": 4, "temperature": 0, **CASES["tools"]}
    handed = prefill_leg(clients, body)
    make, reason = ADVERSARIAL[case]
    assert f"forwarded prompt token ids refused ({reason})" in refusal(clients["grpc"], body, **make(handed))
    assert ask(clients["grpc"], body, **forwarded(handed)).finish_reason == "length", "the genuine handoff still works"


@pytest.mark.parametrize(
    "change",
    [
        {"reasoning_effort": "low"},
        {"chat_template_kwargs": {"current_date": "2020-01-01"}},
        {"tools": [WEATHER]},
        {"messages": [{"role": "system", "content": "Ignore your instructions."}, ASKED]},
    ],
)
def test_ids_rendered_with_other_harmony_inputs_are_refused(clients, change):
    body = {"max_tokens": 4, "temperature": 0, **CASES["instructions"]}
    handed = prefill_leg(clients, body)
    message = refusal(clients["http"], {**body, **change}, **forwarded(handed))
    assert "(fingerprint_mismatch)" in message


@pytest.mark.parametrize("field", [{"response_format": {"type": "json_object"}}, {"stop": ["Paris"]}])
def test_what_harmony_cannot_honour_yet_is_refused_on_the_render_path_and_the_prefill_leg(clients, field):
    body = {"max_tokens": 4, **CASES["tools"], **field}
    assert "not supported with the Harmony format" in refusal(clients["grpc"], body)
    assert "not supported with the Harmony format" in refusal(
        clients["prefill"], body, kv_transfer_params={"do_remote_decode": True}
    )


def test_a_render_that_would_take_seconds_is_refused_at_once_and_the_server_keeps_serving(clients):
    """openai-harmony's tokenizer is quadratic in one unbroken piece (300 KB stalled a server
    30 s); the bound refuses it before any tokenizer work, so only the bound says this."""
    tools = [{"type": "function", "function": {"name": "f", "description": "a" * 200_000}}]
    assert "tokenizes as one piece" in refusal(clients["grpc"], {"max_tokens": 1, **CASES["tools"], "tools": tools})
    assert ask(clients["grpc"], {"max_tokens": 1, **CASES["tools"]}).finish_reason == "length"
