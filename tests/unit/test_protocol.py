import json
import re

import pytest

from pdchat.core.errors import ErrorCode, InvalidRequest, ModelNotFound
from pdchat.core.request.protocol import (
    FIXED_FIELDS,
    ChatRequest,
    GenerationParams,
    parse_chat_json,
    resolve_max_tokens,
    text_input_request,
)


def body(**fields):
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_parses_sampling_and_render_fields():
    request = parse_chat_json(
        body(
            max_completion_tokens=7,
            temperature=0,
            top_p=0.5,
            seed=3,
            stop="END",
            stream=True,
            return_token_ids=True,
            chat_template_kwargs={"enable_thinking": False},
        )
    )
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == (7, 0.0, 0.5, 3)
    assert request.stop == ("END",) and request.stream and request.return_token_ids
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_text_parts_are_joined_and_tool_call_arguments_decoded():
    request = parse_chat_json(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                        ],
                    },
                ]
            }
        )
    )
    assert request.messages[0]["content"] == "a\nb"  # vLLM's rule: text parts joined by newlines
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


UNHONOURED = ["echo", "functions", "best_of", "prediction", "made_up_field"]


@pytest.mark.parametrize("field", UNHONOURED)
def test_a_field_not_honoured_is_refused_by_name(field):
    with pytest.raises(InvalidRequest, match=f"Unrecognized request argument supplied: {field}"):
        parse_chat_json(json.dumps({"messages": [{"role": "user", "content": "x"}], field: 1}))


def test_sampling_controls_are_parsed_normalized_and_reach_generation_params():
    request = parse_chat_json(
        body(
            presence_penalty=0.5,
            frequency_penalty=-1,
            repetition_penalty=1.2,
            logit_bias={"007": -100, "12": 5.5},
            top_k=-1,
            min_p=0.1,
            min_tokens=3,
            max_tokens=8,
            stop_token_ids=[2, 9],
            logprobs=True,
            top_logprobs=4,
            parallel_tool_calls=False,
        )
    )
    params = request.generation_params(10, 100, 1000, "m")
    for options in (request, params):
        assert (options.presence_penalty, options.frequency_penalty, options.repetition_penalty) == (0.5, -1.0, 1.2)
        assert options.logit_bias == {"7": -100.0, "12": 5.5}
        assert (options.top_k, options.min_p, options.min_tokens, options.stop_token_ids) == (0, 0.1, 3, (2, 9))
        assert (options.logprobs, options.top_logprobs, options.parallel_tool_calls) == (True, 4, False)
    assert GenerationParams.from_json(params.to_json()) == params
    assert ChatRequest.from_json(request.to_json()) == request
    defaults = parse_chat_json(body()).generation_params(10, 100, 1000, "m")
    assert (defaults.repetition_penalty, defaults.top_k, defaults.logit_bias, defaults.parallel_tool_calls) == (
        1.0,
        0,
        {},
        True,
    )


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"presence_penalty": 2.5}, "'presence_penalty' must be a number in [-2, 2]"),
        ({"frequency_penalty": "a"}, "'frequency_penalty' must be a number in [-2, 2]"),
        ({"repetition_penalty": 0}, "'repetition_penalty' must be a number > 0"),
        (
            {"repetition_penalty": float("inf")},
            "not valid JSON",
        ),  # json.dumps writes Infinity, which is not JSON: refused
        ({"logit_bias": [1]}, "'logit_bias' must be an object"),
        ({"logit_bias": {"-3": 1}}, "'logit_bias' keys must be token ids"),
        ({"logit_bias": {"abc": 1}}, "'logit_bias' keys must be token ids"),
        ({"logit_bias": {"5": 150}}, "'logit_bias[5]' must be a number in [-100, 100]"),
        ({"logit_bias": {"5": None}}, "'logit_bias[5]' must be a number in [-100, 100]"),
        ({"min_tokens": -1}, "'min_tokens' must be an integer >= 0"),
        ({"min_tokens": 9, "max_tokens": 4}, "'min_tokens' (9) must not exceed max_tokens (4)"),
        ({"stop_token_ids": [1, -2]}, "'stop_token_ids' must be a list of token ids"),
        ({"stop_token_ids": 5}, "'stop_token_ids' must be a list of token ids"),
        ({"stop_token_ids": list(range(129))}, "'stop_token_ids' has 129 token ids; at most 128"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "'logit_bias' has 1025 entries; at most 1024"),
        ({"top_k": -2}, "'top_k' must be -1 or 0 (off) or a positive integer"),
        ({"top_k": 1.5}, "'top_k' must be -1 or 0 (off) or a positive integer"),
        ({"min_p": 1.1}, "'min_p' must be a number in [0, 1]"),
        ({"logprobs": 1}, "'logprobs' must be a bool"),
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer in [0, 20]"),
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        ({"parallel_tool_calls": "no"}, "'parallel_tool_calls' must be a bool"),
    ],
)
def test_sampling_controls_out_of_range_are_refused_naming_the_field(fields, needle):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_json(body(**fields))
    assert needle in str(info.value)


def test_token_ids_are_checked_against_the_vocabulary_and_min_tokens_against_the_resolved_max_tokens():
    for fields, needle in [
        ({"logit_bias": {"1000": 1}}, "'logit_bias' names token ids outside this model's vocabulary of 1000: [1000]"),
        (
            {"stop_token_ids": [5, 4000]},
            "'stop_token_ids' names token ids outside this model's vocabulary of 1000: [4000]",
        ),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(needle)):
            parse_chat_json(body(**fields)).generation_params(10, 100, 1000, "m")
    # The default max_tokens leaves room for min_tokens where the context allows, else it is refused.
    assert parse_chat_json(body(min_tokens=300)).generation_params(10, 10_000, 1000, "m").max_tokens == 300
    with pytest.raises(InvalidRequest, match=re.escape("'min_tokens' (300) must not exceed max_tokens (90)")):
        parse_chat_json(body(min_tokens=300)).generation_params(10, 100, 1000, "m")


def test_router_switches_are_honoured_at_this_server_s_behaviour_and_refused_otherwise():
    body = {"messages": [{"role": "user", "content": "x"}], **FIXED_FIELDS}
    parse_chat_json(json.dumps(body))
    with pytest.raises(InvalidRequest, match="'no_stop_trim' can only be false"):
        parse_chat_json(json.dumps({**body, "no_stop_trim": True}))


def test_known_no_op_fields_are_accepted_and_ignored():
    request = parse_chat_json(
        json.dumps(
            {
                "messages": [{"role": "user", "content": "x"}],
                "user": "u1",
                "metadata": {"a": "b"},
                "store": False,
                "service_tier": "auto",
            }
        )
    )
    assert request.messages[0]["content"] == "x"


def test_stream_options_and_kv_transfer_params_in_the_body():
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat_json(
        json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    ).include_usage
    for options, needle in [
        ({"include_usage": True}, "only allowed when 'stream' is true"),
        ({"other": 1}, "takes only"),
    ]:
        with pytest.raises(InvalidRequest, match=needle):
            parse_chat_json(json.dumps({**body, "stream": "other" in options, "stream_options": options}))
    assert parse_chat_json(
        json.dumps({**body, "kv_transfer_params": {"do_remote_decode": True}})
    ).kv_transfer_params == {"do_remote_decode": True}


def with_turns(*messages):
    return json.dumps({"messages": [{"role": "user", "content": "hi"}, *messages]})


def with_call(arguments, name="f"):
    return with_turns(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}],
        }
    )


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"messages": []}), "non-empty list"),
        (json.dumps({}), "non-empty list"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role is 'wizard'"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}), "messages[0].content must be"),
        (
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "only text parts",
        ),
        (body(max_tokens=0), "'max_tokens' must be a positive integer"),
        (body(max_tokens="ten"), "'max_tokens' must be a positive integer"),
        (body(temperature=3), "'temperature' must be a number in [0, 2]"),
        (body(top_p=0), "'top_p'"),
        (body(seed=-1), "'seed'"),
        (body(n=2), "'n' must be 1"),
        (body(stop=[""]), "'stop'"),
        (body(stop=[f"s{i}" for i in range(65)]), "'stop' holds 65 strings; at most 64"),
        (body(stream="yes"), "'stream' must be a bool"),
        (body(tools=[{"type": "function"}]), "tools[0] must be"),
        (body(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
            "parameters must be a JSON schema",
        ),
        (body(chat_template_kwargs=[1]), "'chat_template_kwargs' must be a dict"),
        ('{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "no low surrogate"),
        ("[" * 5000 + "]" * 5000, "depth limit exceeded"),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
            "description must be a string",
        ),
        (
            body(tools=[{"type": "function", "function": {"name": "a.b c"}}]),
            "tools[0].function.name must be 1-64 letters",
        ),
        (
            with_turns({"role": "tool", "tool_call_id": ["a"], "content": "1"}),
            "messages[1].tool_call_id must be a string",
        ),
        (
            with_turns({"role": "user", "content": "a", "name": "bob"}),
            "messages[1].name is only taken on tool messages",
        ),
        (
            with_turns({"role": "assistant", "content": "a", "reasoning_content": ["x"]}),
            "reasoning_content must be a string",
        ),
        (
            with_turns({"role": "user", "content": "a", "reasoning_content": "x"}),
            "reasoning_content is only taken on assistant",
        ),
        (with_call('{"x": NaN}'), "arguments is not valid JSON: NaN is not JSON"),
        (with_call('{"x": Infinity}'), "Infinity is not JSON"),
        (with_call('{"x": 1e400}'), "out of range"),
        (with_call('{"x": 123456789012345678901234567890}'), "does not fit 64 bits"),
        (with_call("{}", name="x y"), "function.name must be 1-64 letters"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(raw, needle):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_json(raw)
    assert needle in str(info.value)


def test_escaped_surrogate_pairs_are_text_and_accepted():
    request = parse_chat_json('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert request.messages[0]["content"] == "\U0001f600"


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
    params = request.generation_params(10, 100, 1000, "m")
    assert GenerationParams.from_json(params.to_json()) == params
    assert params.request_id.startswith("chatcmpl-") and params.model == "m"
    # No seed in the request: one is chosen, so prefill and decode sample alike.
    assert isinstance(params.seed, int)
    with pytest.raises(InvalidRequest):
        GenerationParams.from_json('{"bogus": 1}')


TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
]


def test_tool_choice_and_response_format_become_one_constraint():
    assert parse_chat_json(body(tools=TOOLS)).parse_tool_calls
    assert not parse_chat_json(body(tools=TOOLS, tool_choice="none")).parse_tool_calls
    assert parse_chat_json(body(tools=TOOLS, tool_choice="required")).constraint["type"] == "tool_call"
    named = parse_chat_json(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}))
    assert [t["name"] for t in named.constraint["tools"]] == ["f"]
    assert parse_chat_json(body(response_format={"type": "json_object"})).constraint == {"type": "json_object"}
    assert parse_chat_json(body(response_format={"type": "text"})).constraint is None


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice needs 'tools'"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "'g', which is not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "needs json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
            "cannot build a grammar",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)
def test_bad_structured_output_requests(fields, needle):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_json(body(**fields))
    assert needle in str(info.value)


def test_settings_prefer_config_parameter_then_environment_then_default():
    from pdchat.core.errors import ModelUnavailable
    from pdchat.core.settings import forwarded_ids_policy, handoff_ttl_s

    assert forwarded_ids_policy({}, {}) == "off"
    assert forwarded_ids_policy({}, {"PDCHAT_FORWARDED_IDS": "trusted"}) == "trusted"
    assert forwarded_ids_policy({"forwarded_ids": "signed"}, {"PDCHAT_FORWARDED_IDS": "trusted"}) == "signed"
    assert handoff_ttl_s({}, {}) == 60.0 and handoff_ttl_s({"handoff_ttl_s": "2.5"}, {}) == 2.5
    with pytest.raises(ModelUnavailable):
        handoff_ttl_s({}, {"PDCHAT_HANDOFF_TTL_S": "-1"})


@pytest.mark.parametrize("n", [True, 1.0, "1", 2, 0])
def test_n_is_the_integer_1(n):
    with pytest.raises(InvalidRequest, match=re.escape("'n' must be 1, an integer") + ".*" + re.escape(f"got {n!r}")):
        parse_chat_json(body(n=n))


@pytest.mark.parametrize("n", [1, None])
def test_n_of_1_or_null_is_one_choice(n):
    assert parse_chat_json(body(n=n)).messages[0]["content"] == "hi"


@pytest.mark.parametrize(
    ("key", "value"), [("skip_special_tokens", 1), ("no_stop_trim", 0), ("include_reasoning", "true")]
)
def test_router_switches_are_booleans_not_their_lookalikes(key, value):
    with pytest.raises(InvalidRequest, match=f"'{key}' can only be"):
        parse_chat_json(body(**{key: value}))


def test_max_completion_tokens_wins_but_a_null_one_leaves_max_tokens_and_both_are_checked():
    assert parse_chat_json(body(max_completion_tokens=None, max_tokens=5)).max_tokens == 5
    assert parse_chat_json(body(max_completion_tokens=7, max_tokens=5)).max_tokens == 7
    with pytest.raises(InvalidRequest, match="'max_tokens' must be a positive integer"):
        parse_chat_json(body(max_completion_tokens=7, max_tokens="ten"))
    with pytest.raises(InvalidRequest, match="'max_completion_tokens' must be a positive integer"):
        parse_chat_json(body(max_completion_tokens=True))


ASSISTANT_ECHO = {
    "role": "assistant",
    "content": "hello",
    "reasoning_content": "greet",
    "refusal": None,
    "audio": None,
    "function_call": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


def test_honoured_message_keys_pass_and_openai_s_unrendered_ones_pass_when_null():
    request = parse_chat_json(
        with_turns(ASSISTANT_ECHO, {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "1"})
    )
    assert request.messages[1]["content"] == "hello" and request.messages[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            with_turns({"role": "user", "content": "hi", "colour": 1}),
            "messages[1] has 'colour', which this server does not take; it takes role, content, tool_calls (assistant)",
        ),
        (with_turns({"role": "user", "content": "hi", "colour": None}), "messages[1] has 'colour'"),
        (with_turns({"role": "tool", "content": "18 C"}), "messages[1] is a tool result without 'tool_call_id'"),
        (with_turns({"role": "tool", "tool_call_id": "", "content": "1"}), "without 'tool_call_id'"),
        (with_turns({**ASSISTANT_ECHO, "refusal": "I can't"}), "messages[1].refusal is not rendered by this server"),
        (with_turns({**ASSISTANT_ECHO, "function_call": {"name": "f"}}), "messages[1].function_call is not rendered"),
        (with_turns({**ASSISTANT_ECHO, "audio": {"id": "a"}}), "messages[1].audio is not rendered"),
        (
            with_turns({"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}),
            "messages[1].content[0] has 'cache_control', which this server does not take; it takes type, text",
        ),
        (
            with_turns({**ASSISTANT_ECHO, "tool_calls": [{**ASSISTANT_ECHO["tool_calls"][0], "index": 0}]}),
            "messages[1].tool_calls[0] has 'index', which this server does not take; it takes id, type, function",
        ),
        (
            with_turns({**ASSISTANT_ECHO, "tool_calls": [{"type": "function", "function": {"name": "f", "x": 1}}]}),
            "messages[1].tool_calls[0].function has 'x'",
        ),
        (
            with_turns({**ASSISTANT_ECHO, "tool_calls": [{"type": "custom", "function": {"name": "f"}}]}),
            "messages[1].tool_calls[0] must be {'type': 'function'",
        ),
        (
            with_turns({**ASSISTANT_ECHO, "tool_calls": [{"id": 7, "function": {"name": "f"}}]}),
            "messages[1].tool_calls[0].id must be a string",
        ),
        (body(tools=[{**TOOLS[0], "colour": 1}]), "tools[0] has 'colour', which this server does not take"),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "parameter": {}}}]),
            "tools[0].function has 'parameter', which this server does not take; "
            "it takes name, description, parameters, strict",
        ),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
            "tools[0].function.strict must be a bool",
        ),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]),
            "tools[0].function.strict is true, which this server keeps only when tool_choice is 'required'",
        ),
        (
            body(tools=TOOLS, tool_choice={"type": "function", "function": [1]}),
            "tool_choice must be 'none', 'auto', 'required'",
        ),
        (body(tools=TOOLS, tool_choice={"type": "tool", "function": {"name": "f"}}), "tool_choice must be"),
        (body(tools=TOOLS, tool_choice={"function": {"name": "f"}}), "tool_choice must be"),
        (body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f", "x": 1}}), "with no other keys"),
        (
            body(response_format={"type": "json_object", "schema": {"type": "object"}}),
            "response_format has 'schema', which this server does not take; it takes type",
        ),
        (
            body(response_format={"type": "text", "json_schema": {"schema": {}}}),
            "response_format has 'json_schema'",
        ),
        (body(response_format={"type": "json_schema", "json_schema": [1]}), "needs json_schema.schema"),
        (
            body(response_format={"type": "json_schema", "json_schema": {"schema": {}, "schema_": {}}}),
            "response_format.json_schema has 'schema_', which this server does not take; "
            "it takes name, description, schema, strict",
        ),
        (
            body(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}),
            "response_format.json_schema.strict must be a bool",
        ),
        (
            body(response_format={"type": "json_schema", "json_schema": {"schema": {}, "name": 5}}),
            "response_format.json_schema.name must be a str",
        ),
    ],
)
def test_what_a_nested_object_carries_unread_is_refused_by_name(raw, needle):
    with pytest.raises(InvalidRequest) as info:
        parse_chat_json(raw)
    assert needle in str(info.value)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}, "none"], ids=str)
def test_strict_tools_are_kept_where_calls_follow_their_schema_or_none_is_made(tool_choice):
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    request = parse_chat_json(body(tools=tools, tool_choice=tool_choice))
    assert request.tools == tools


def test_json_schema_options_openai_sends_are_taken():
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "description": "d", "schema": {"type": "object"}, "strict": True},
    }
    assert parse_chat_json(body(response_format=response_format)).constraint == {
        "type": "json_schema",
        "schema": {"type": "object"},
    }


def test_every_served_name_is_taken_the_first_reported_and_another_is_model_not_found():
    names = ("tiny", "tiny-llama")
    for model in (None, "", "tiny", "tiny-llama"):
        params = parse_chat_json(body(**({} if model is None else {"model": model}))).generation_params(
            10, 100, 1000, names
        )
        assert params.model == "tiny"
    with pytest.raises(
        ModelNotFound, match="model 'gpt-9' is not served here; this server serves 'tiny', 'tiny-llama'"
    ):
        parse_chat_json(body(model="gpt-9")).generation_params(10, 100, 1000, names)
    assert ModelNotFound.code is ErrorCode.NOT_FOUND and issubclass(ModelNotFound, InvalidRequest)
