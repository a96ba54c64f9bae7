import json

import pytest

from pdchat.core.errors import InvalidRequest
from pdchat.core.protocol import GenerationParams, parse_chat_json, resolve_max_tokens, text_input_request


def body(**fields):
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_parses_sampling_and_render_fields():
    request = parse_chat_json(
        body(
            max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, stop="END", stream=True,
            return_token_ids=True, chat_template_kwargs={"enable_thinking": False},
        )
    )
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == (7, 0.0, 0.5, 3)
    assert request.stop == ("END",) and request.stream and request.return_token_ids
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_text_parts_are_joined_and_tool_call_arguments_decoded():
    request = parse_chat_json(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
    ]}))
    assert request.messages[0]["content"] == "ab"
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"messages": []}), "non-empty list"),
        (json.dumps({}), "non-empty list"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role is 'wizard'"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}), "messages[0].content must be"),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}), "only text parts"),
        (body(max_tokens=0), "'max_tokens' must be a positive integer"),
        (body(max_tokens="ten"), "'max_tokens' must be a positive integer"),
        (body(temperature=3), "'temperature' must be a number in [0, 2]"),
        (body(top_p=0), "'top_p'"),
        (body(seed=-1), "'seed'"),
        (body(n=2), "'n' must be 1"),
        (body(stop=[""]), "'stop'"),
        (body(stream="yes"), "'stream' must be a bool"),
        (body(tools=[{"type": "function"}]), "tools[0] must be"),
        (body(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
        (body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "parameters must be a JSON schema"),
        (body(chat_template_kwargs=[1]), "'chat_template_kwargs' must be a dict"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(raw, needle):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_json(raw)
    assert needle in str(info.value)


def test_text_input_is_one_user_message_and_greedy_by_default():
    request = text_input_request("hello", max_tokens=4)
    assert request.messages == [{"role": "user", "content": "hello"}]
    assert request.temperature == 0.0 and request.max_tokens == 4
    assert request.echo_text == "hello"
    assert text_input_request("hello", exclude_input_in_output=True).echo_text == ""
    with pytest.raises(InvalidRequest, match="empty"):
        text_input_request("   ")


def test_max_tokens_must_fit_the_context():
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(None, 10, 10_000) == 256
    assert resolve_max_tokens(5, 10, 100) == 5
    with pytest.raises(InvalidRequest, match="max_tokens=91 does not fit"):
        resolve_max_tokens(91, 10, 100)
    with pytest.raises(InvalidRequest, match="no room"):
        resolve_max_tokens(None, 100, 100)


def test_generation_params_round_trip_and_fixed_seed():
    request = parse_chat_json(body(stop=["a", "b"], max_tokens=3))
    params = request.generation_params(10, 100, "m")
    assert GenerationParams.from_json(params.to_json()) == params
    assert params.request_id.startswith("chatcmpl-") and params.model == "m"
    # No seed in the request: one is chosen, so prefill and decode sample alike.
    assert isinstance(params.seed, int)
    with pytest.raises(InvalidRequest):
        GenerationParams.from_json('{"bogus": 1}')
