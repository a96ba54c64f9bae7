"""Parsing generated text into content, reasoning_content and tool_calls, streamed or whole."""

import json

import pytest

from pdchat.core.output.parsing import OutputParser, ParsedDelta, starts_in_reasoning


def parse(text, *, pieces=1, **options):
    """Feed `text` in chunks of `pieces` characters (1 = worst case streaming)."""
    parser = OutputParser(**{"reasoning": True, "tools": True, **options})
    total = ParsedDelta()
    for start in range(0, len(text), pieces):
        total.extend(parser.feed(text[start : start + pieces]))
    total.extend(parser.finish())
    return total


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_reasoning_then_content(pieces):
    out = parse("<think>\nWeigh options.\n</think>\n\nThe answer is 4.", pieces=pieces)
    assert out.reasoning == "\nWeigh options.\n"
    assert out.content == "The answer is 4."
    assert out.tool_calls == []


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_tool_calls_between_content(pieces):
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "t2", "arguments": {}}\n</tool_call>'
    out = parse(text, pieces=pieces)
    assert out.content == "Checking.\n\n"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "t2", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in out.tool_calls)


def test_unparsable_or_unclosed_tool_call_comes_back_as_content():
    assert parse("<tool_call>{not json}</tool_call>").content == "<tool_call>{not json}</tool_call>"
    unclosed = parse('<tool_call>{"name": "f"')
    assert unclosed.content == '<tool_call>{"name": "f"' and unclosed.tool_calls == []


def test_markers_are_plain_text_when_their_feature_is_off():
    text = "<think>x</think> and <tool_call>{}</tool_call>"
    assert parse(text, reasoning=False, tools=False).content == text


def test_answer_starting_inside_an_open_think_block():
    out = parse("still thinking</think>done", in_reasoning=True)
    assert (out.reasoning, out.content) == ("still thinking", "done")
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\nLet me")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_partial_marker_is_held_back_then_released():
    parser = OutputParser(reasoning=True, tools=True)
    assert parser.feed("a <thi").content == "a "
    assert parser.feed("s is not a tag").content == "<this is not a tag"


@pytest.mark.parametrize("pieces", [1, 4, 1000])
def test_max_tool_calls_ends_parsing_with_the_call_that_reaches_it(pieces):
    text = 'Sure.<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    out = parse(text, pieces=pieces, max_tool_calls=1)
    assert out.content == "Sure." and [c["function"]["name"] for c in out.tool_calls] == ["a"]
    assert [c["function"]["name"] for c in parse(text, pieces=pieces).tool_calls] == ["a", "b"]


def test_an_unparsable_call_does_not_count_towards_max_tool_calls():
    out = parse('<tool_call>{bad}</tool_call><tool_call>{"name": "a"}</tool_call>tail', max_tool_calls=1)
    assert out.content == "<tool_call>{bad}</tool_call>" and len(out.tool_calls) == 1


def test_a_stream_that_failed_mid_way_is_a_client_error_with_its_class():
    import pytest

    from pdchat.clients.chat import ChatError, _to_output
    from pdchat.core.errors import ErrorCode

    body = json.dumps({"error": {"message": "[UNAVAILABLE] decode is full", "type": "UNAVAILABLE"}})
    outputs = {"text_output": b"", "response": body.encode(), "finish_reason": b"error"}
    with pytest.raises(ChatError, match="decode is full") as info:
        _to_output(outputs.get)
    assert info.value.code is ErrorCode.UNAVAILABLE
