"""The Harmony path (GPT-OSS) without a server: vocabulary, rendering, parsing, fingerprint.

The reference is openai-harmony itself: each conversation is also built by hand with its
API and rendered by it, and the renderer's ids must equal those token for token.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.request import harmony_vocab
from pdchat.core.request.protocol import chat_request_from_body
from pdchat.ensemble.handoff import render_fingerprint
from tests.conversations import WEATHER_TOOL as WEATHER

DATE = "2026-11-30"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def gptoss_dir():
    from pdchat import embedded, registry

    return embedded.ensure_model(registry.TINY_GPTOSS)


@pytest.fixture(scope="module")
def renderer(gptoss_dir):
    from pdchat.core.request.harmony import HarmonyRenderer

    return HarmonyRenderer(gptoss_dir, gptoss_dir.name, current_date=DATE)


@pytest.fixture(scope="module")
def h():
    """openai-harmony, its vocabulary loaded from the verified offline file."""
    import openai_harmony

    harmony_vocab.harmony_encoding()
    return openai_harmony


def request(**body):
    return chat_request_from_body({"messages": [{"role": "user", "content": "Hi"}], **body})


def system(h, effort="Medium", date=DATE):
    return h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(effort)).with_conversation_start_date(date)


def weather_tool(h):
    return h.ToolDescription.new("get_weather", "Current weather in a city", WEATHER["function"]["parameters"])


def harmony_ids(h, messages):
    encoding = harmony_vocab.harmony_encoding()
    return encoding.render_conversation_for_completion(h.Conversation.from_messages(messages), h.Role.ASSISTANT)


def cases(h):
    """(request body, the same conversation built with openai-harmony's API)."""
    message, role = h.Message, h.Role
    user = message.from_role_and_content(role.USER, "What is the weather in Paris?")
    developer = h.DeveloperContent.new().with_instructions("Answer briefly.\n\nUse metric units.")
    call = (
        message.from_role_and_content(role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json")
    )
    result = (
        message.from_author_and_content(h.Author.new(role.TOOL, "functions.get_weather"), '{"temp_c": 21}')
        .with_channel("commentary")
        .with_recipient("assistant")
    )
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    return {
        "instructions": (
            {
                "messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "developer", "content": "Use metric units."},
                    *asked,
                ],
                "reasoning_effort": "high",
            },
            [
                message.from_role_and_content(role.SYSTEM, system(h, "High")),
                message.from_role_and_content(role.DEVELOPER, developer),
                user,
            ],
        ),
        "tools": (
            {"messages": asked, "tools": [WEATHER]},
            [
                message.from_role_and_content(role.SYSTEM, system(h)),
                message.from_role_and_content(
                    role.DEVELOPER, h.DeveloperContent.new().with_function_tools([weather_tool(h)])
                ),
                user,
            ],
        ),
        "tool_call_and_result": (
            {
                "messages": [
                    *asked,
                    {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "I should look it up.",
                        "tool_calls": [CALL],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
                ],
                "tools": [WEATHER],
                "reasoning_effort": "low",
            },
            [
                message.from_role_and_content(role.SYSTEM, system(h, "Low")),
                message.from_role_and_content(
                    role.DEVELOPER, h.DeveloperContent.new().with_function_tools([weather_tool(h)])
                ),
                user,
                message.from_role_and_content(role.ASSISTANT, "I should look it up.").with_channel("analysis"),
                call,
                result,
            ],
        ),
        "multi_turn_with_earlier_reasoning": (
            {
                "messages": [
                    {"role": "user", "content": "Pick a number."},
                    {"role": "assistant", "content": "Seven.", "reasoning_content": "Any will do; seven."},
                    {"role": "user", "content": "Another one?"},
                ],
                "chat_template_kwargs": {"current_date": "2025-01-02"},
            },
            [
                message.from_role_and_content(role.SYSTEM, system(h, date="2025-01-02")),
                message.from_role_and_content(role.USER, "Pick a number."),
                message.from_role_and_content(role.ASSISTANT, "Any will do; seven.").with_channel("analysis"),
                message.from_role_and_content(role.ASSISTANT, "Seven.").with_channel("final"),
                message.from_role_and_content(role.USER, "Another one?"),
            ],
        ),
    }


@pytest.mark.parametrize("case", ["instructions", "tools", "tool_call_and_result", "multi_turn_with_earlier_reasoning"])
def test_renderer_ids_equal_openai_harmonys_own_rendering(renderer, h, case):
    body, messages = cases(h)[case]
    ids = renderer.render(chat_request_from_body(body)).prompt_token_ids
    assert ids == harmony_ids(h, messages)
    assert renderer.tokenizer.decode(ids[-2:]) == "<|start|>assistant"


def test_earlier_reasoning_is_dropped_by_harmony_itself(renderer, h):
    body, _ = cases(h)["multi_turn_with_earlier_reasoning"]
    text = renderer.tokenizer.decode(renderer.render(chat_request_from_body(body)).prompt_token_ids)
    assert "Seven." in text and "Any will do" not in text


def test_the_embedded_tokenizer_tokenizes_as_harmonys_encoding(renderer):
    encoding = harmony_vocab.harmony_encoding()
    for text in [
        "Hello, world! It's 2026.",
        "naïve café ☕ 日本語 ",
        "<|start|>user<|message|>x<|end|>",
        "  indented\n\tcode()\r\n",
    ]:
        assert renderer.tokenizer(text, add_special_tokens=False)["input_ids"] == encoding.encode(
            text, allowed_special="all"
        )
    assert len(renderer.tokenizer) == renderer.vocab_size == 201088


def test_the_vocabulary_is_the_genuine_file_and_a_wrong_one_is_refused(tmp_path, monkeypatch):
    genuine = harmony_vocab.tiktoken_dir() / harmony_vocab.TIKTOKEN_FILE
    assert hashlib.sha256(genuine.read_bytes()).hexdigest() == harmony_vocab.TIKTOKEN_SHA256
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    (tmp_path / "tiktoken").mkdir()
    (tmp_path / "tiktoken" / harmony_vocab.TIKTOKEN_FILE).write_bytes(genuine.read_bytes().replace(b" 1\n", b" 2\n", 1))
    with pytest.raises(ModelUnavailable, match="not the genuine"):
        harmony_vocab.tiktoken_dir()


def test_quicktoks_binary_vocabulary_converts_line_by_line():
    vocab = b"\x02\x00\x00\x00" + b"\x01\x00A" + b"\x00\x00\x00\x00" + b"\x02\x00\xc3\xa9" + b"\x01\x00\x00\x00"
    assert harmony_vocab.tiktoken_text(vocab) == b"QQ== 0\nw6k= 1\n"
    with pytest.raises(ModelUnavailable, match="past its 2 tokens"):
        harmony_vocab.tiktoken_text(vocab + b"\x00")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {
                "continue_final_message": True,
                "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            },
            "continue_final_message is not supported by the Harmony format",
        ),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "may only set 'current_date'"),
        ({"chat_template_kwargs": {"current_date": "30/11/2026"}}, "must be a date as YYYY-MM-DD"),
        ({"chat_template_kwargs": {"current_date": "2025-13-45"}}, "must be a date as YYYY-MM-DD"),
        (
            {"messages": [{"role": "user", "content": "a" * 5000}]},
            "a run of 5000 characters that tokenizes as one piece",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": " " * 9000 + "x"}}]},
            "tokenizes as one piece",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": "w " * 140000}}]},
            "the messages and tools hold",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}]},
            "names no earlier tool call",
        ),
    ],
)
def test_what_harmony_cannot_render_is_refused_by_name(renderer, body, message):
    with pytest.raises(InvalidRequest, match=message):
        renderer.render(request(**body))


def test_the_server_date_renders_unless_the_request_names_one(renderer):
    assert f"Current date: {DATE}" in renderer.tokenizer.decode(renderer.render(request()).prompt_token_ids)
    other = request(chat_template_kwargs={"current_date": "2024-02-29"})
    assert "Current date: 2024-02-29" in renderer.tokenizer.decode(renderer.render(other).prompt_token_ids)
    assert renderer.render_defaults() == {"format": "harmony", "current_date": DATE}


def test_the_fingerprint_covers_every_harmony_render_input(renderer):
    base = request()
    variants = [
        request(reasoning_effort="high"),
        request(tools=[WEATHER]),
        request(messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]),
        request(chat_template_kwargs={"current_date": "2024-02-29"}),
    ]
    prints = {render_fingerprint(r, "m", renderer.render_defaults()) for r in [base, *variants]}
    assert len(prints) == 1 + len(variants)
    assert render_fingerprint(base, "m", {"format": "harmony", "current_date": "2020-01-01"}) != render_fingerprint(
        base, "m", renderer.render_defaults()
    ), "the server's date is a render input too"


# --- output parsing -------------------------------------------------------------------


def parse(tokens, *, tools=True, max_tool_calls=None):
    """Feed `tokens` one at a time, as decode does; the deltas merged, and each delta."""
    from pdchat.core.output.harmony import HarmonyOutputParser
    from pdchat.core.output.parsing import ParsedDelta

    encoding = harmony_vocab.harmony_encoding()
    parser = HarmonyOutputParser(encoding, _decoder(encoding), tools=tools, max_tool_calls=max_tool_calls)
    merged, deltas = ParsedDelta(), []
    for token in tokens:
        delta = parser.feed("", [token])
        deltas.append(delta)
        merged.extend(delta)
    merged.extend(parser.finish())
    return merged, deltas


def _decoder(encoding):
    """Text without special tokens, as decode's tokenizer spells it (skip_special_tokens)."""
    return lambda ids: encoding.decode([i for i in ids if not encoding.is_special_token(i)])


def encode(text):
    return harmony_vocab.harmony_encoding().encode(text, allowed_special="all")


def test_a_hand_written_completion_parses_into_reasoning_then_a_tool_call():
    completion = (
        "<|channel|>analysis<|message|>The user wants Paris weather. Call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    merged, deltas = parse(encode(completion))
    assert merged.reasoning == "The user wants Paris weather. Call the tool."
    assert merged.content == ""
    [call] = merged.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    assert call["type"] == "function" and call["id"].startswith("call_") and call["index"] == 0
    assert sum(bool(d.reasoning) for d in deltas) > 3, "reasoning streams token by token"
    assert [bool(d.tool_calls) for d in deltas][-1], "the call is emitted whole when <|call|> ends it"


def test_final_channel_is_content_and_preambles_too():
    completion = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
        "<|end|><|start|>assistant<|channel|>final<|message|>It is 21 C.<|return|>"
    )
    merged, _ = parse(encode(completion))
    assert (merged.reasoning, merged.content, merged.tool_calls) == ("Think.", "Checking.It is 21 C.", [])


def test_calls_are_content_when_the_request_offered_no_tools_and_nothing_is_dropped():
    completion = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>'
    merged, _ = parse(encode(completion), tools=False)
    assert merged.tool_calls == [] and merged.content == '{"city": "Rome"}'


def test_output_that_is_not_harmony_comes_back_as_content():
    merged, _ = parse(encode("plain words, no channel at all"))
    assert merged.content == "plain words, no channel at all"
    cut, _ = parse(encode('<|channel|>commentary to=functions.get_weather<|message|>{"ci'))
    assert cut.content == '{"ci' and cut.tool_calls == [], "a call cut off by max_tokens is passed on"
    long_header = encode("<|channel|>" + "word " * 100)
    merged, deltas = parse(long_header)
    assert merged.content.startswith("word word") and any(d.content for d in deltas), (
        "a runaway header streams as content"
    )


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format and a forced tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "response_format and a forced tool_choice"),
        ({"stop": ["Paris"]}, "'stop' strings are not supported"),
    ],
)
def test_harmony_refuses_what_it_cannot_honour_yet_at_the_stages(gptoss_dir, fields, refused):
    from pdchat.core.generation.generation import TextModel

    model = TextModel(gptoss_dir, "cpu")
    params = request(**fields).generation_params(10, 1000, model.engine.vocab_size, "m")
    with pytest.raises(InvalidRequest, match=refused):
        model.chooser([1, 2, 3], params)
