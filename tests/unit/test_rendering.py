import json

import pytest

from pdchat.core.errors import InvalidRequest
from pdchat.core.protocol import parse_chat_json
from pdchat.core.rendering import ChatRenderer
from tests.conversations import WEATHER_TOOL


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return ChatRenderer(tiny_model_dir, tiny_model_dir.name)


def render_text(renderer, **fields):
    rendered = renderer.render(parse_chat_json(json.dumps(fields)))
    return renderer.tokenizer.decode(rendered.prompt_token_ids), rendered


def test_plain_conversation_is_chatml_with_generation_prompt(renderer):
    text, rendered = render_text(renderer, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☕"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☕<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.params.max_tokens == 256 and rendered.params.model == "tiny-llama"


def test_tools_calls_and_results_are_rendered(renderer):
    text, _ = render_text(renderer, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


def test_enable_thinking_false_closes_the_reasoning_block(renderer):
    on, _ = render_text(renderer, messages=[{"role": "user", "content": "x"}])
    off, _ = render_text(renderer, messages=[{"role": "user", "content": "x"}],
                         chat_template_kwargs={"enable_thinking": False})
    assert off == on + "<think>\n\n</think>\n\n"


def test_continue_final_message_leaves_the_assistant_turn_open(renderer):
    text, _ = render_text(renderer, continue_final_message=True, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure, the"}])
    assert text.endswith("<|im_start|>assistant\nSure, the")


def test_unknown_model_name_is_refused(renderer):
    with pytest.raises(InvalidRequest, match="model 'gpt-9' is not served here; this server serves 'tiny-llama'"):
        render_text(renderer, model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_huge_max_tokens_is_refused_with_the_numbers(renderer):
    with pytest.raises(InvalidRequest, match=r"max_tokens=1000000 does not fit: this model's context is 16384"):
        render_text(renderer, max_tokens=1_000_000, messages=[{"role": "user", "content": "x"}])


def test_template_without_tools_refuses_tools(renderer, monkeypatch):
    monkeypatch.setattr(renderer, "supports_tools", False)
    with pytest.raises(InvalidRequest, match="does not support tools"):
        render_text(renderer, tools=[WEATHER_TOOL], messages=[{"role": "user", "content": "x"}])
