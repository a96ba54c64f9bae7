import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.request.protocol import parse_chat_json
from pdchat.core.request.rendering import ChatRenderer
from pdchat.core.settings import allow_request_templates, render_timeout_s
from tests.conversations import WEATHER_TOOL


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return ChatRenderer(tiny_model_dir, tiny_model_dir.name)


def render_text(renderer, **fields):
    rendered = renderer.render(parse_chat_json(json.dumps(fields)))
    return renderer.tokenizer.decode(rendered.prompt_token_ids), rendered


def test_plain_conversation_is_chatml_with_generation_prompt(renderer):
    text, rendered = render_text(
        renderer, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☕"}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☕<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.params.max_tokens == 256 and rendered.params.model == "tiny-llama"


def test_tools_calls_and_results_are_rendered(renderer):
    text, _ = render_text(
        renderer,
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
        ],
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


def test_enable_thinking_false_closes_the_reasoning_block(renderer):
    on, _ = render_text(renderer, messages=[{"role": "user", "content": "x"}])
    off, _ = render_text(
        renderer, messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"enable_thinking": False}
    )
    assert off == on + "<think>\n\n</think>\n\n"


def test_continue_final_message_leaves_the_assistant_turn_open(renderer):
    text, _ = render_text(
        renderer,
        continue_final_message=True,
        messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure, the"}],
    )
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


# Request templates and chat_template_kwargs: the template is the server's.
USER = [{"role": "user", "content": "hi"}]
# The arguments of transformers 5's apply_chat_template/render_jinja_template, the
# conversation and the special tokens: none is a template variable a request may set.
KNOWN_RESERVED = (
    "chat_template",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
    "conversation",
    "conversations",
    "messages",
    "bos_token",
    "eos_token",
)
SLOW_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
BOUND_S = 1.0


@pytest.fixture(scope="module")
def permissive(tiny_model_dir):
    """A renderer whose operator lets requests bring their own chat template."""
    return ChatRenderer(tiny_model_dir, tiny_model_dir.name, allow_request_templates=True, render_timeout_s=BOUND_S)


def test_a_request_template_is_refused_by_default(renderer):
    with pytest.raises(InvalidRequest, match="may not set 'chat_template': this server renders with the model's own"):
        render_text(
            renderer, messages=USER, chat_template_kwargs={"chat_template": "SYSTEM OVERRIDE {{ messages[0].content }}"}
        )


def test_every_reserved_argument_is_refused(renderer):
    assert set(KNOWN_RESERVED) <= renderer.reserved_kwargs
    for key in sorted(renderer.reserved_kwargs):
        with pytest.raises(InvalidRequest, match=f"may not set '{key}'"):
            render_text(renderer, messages=USER, chat_template_kwargs={key: True})


def test_an_allowed_request_template_is_rendered_and_nothing_else_reserved_is(permissive):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    text, _ = render_text(permissive, messages=USER, chat_template_kwargs={"chat_template": template})
    assert text == "[user] hi\n"
    with pytest.raises(InvalidRequest, match="may not set 'tokenize'"):
        render_text(permissive, messages=USER, chat_template_kwargs={"chat_template": template, "tokenize": False})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"x": {"a": 1}},
            r"\['x'\] must be a string, number, boolean, null or a list of at most 64 of those, got dict",
        ),
        ({"x": [[1]]}, r"\['x'\] must be a string, number, boolean, null .* got list"),
        ({"x": list(range(65))}, r"\['x'\] has 65 items; at most 64"),
        ({"x": "é" * 2049}, r"\['x'\] is longer than 4096 bytes"),
        ({f"k{i}": 1 for i in range(33)}, "has 33 keys; at most 32"),
    ],
)
def test_template_variables_are_small_json_scalars(renderer, kwargs, needle):
    with pytest.raises(InvalidRequest, match=needle):
        render_text(renderer, messages=USER, chat_template_kwargs=kwargs)


def test_template_variables_at_their_limits_are_accepted(renderer):
    kwargs = {"enable_thinking": False, "name": "a" * 4096, "tags": ["a", 1, 2.5, True, None] * 12, "n": None}
    kwargs |= {f"k{i}": i for i in range(32 - len(kwargs))}
    off, _ = render_text(renderer, messages=USER, chat_template_kwargs=kwargs)
    assert off.endswith("<think>\n\n</think>\n\n")


def test_a_request_template_must_be_a_string(permissive):
    with pytest.raises(InvalidRequest, match=r"\['chat_template'\] must be a string, got list"):
        render_text(permissive, messages=USER, chat_template_kwargs={"chat_template": ["{{ 1 }}"]})


def test_a_slow_template_is_cut_at_the_bound_and_the_renderer_serves_on(permissive):
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=f"took longer than {BOUND_S:g} s to render"):
        render_text(permissive, messages=USER, chat_template_kwargs={"chat_template": SLOW_TEMPLATE})
    assert time.monotonic() - started < BOUND_S + 0.5
    text, _ = render_text(permissive, messages=USER)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>")


def test_the_bound_restores_the_previous_alarm(renderer):
    def outer(signum, frame):
        raise AssertionError("the outer alarm fired during the test")

    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 60)
    try:
        render_text(renderer, messages=USER)
        assert signal.getsignal(signal.SIGALRM) is outer
        assert 55 < signal.getitimer(signal.ITIMER_REAL)[0] <= 60
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_rendering_runs_unbounded(renderer):
    with ThreadPoolExecutor(1) as pool:
        text, _ = pool.submit(render_text, renderer, messages=USER).result()
    assert text.startswith("<|im_start|>user\nhi")


@pytest.mark.parametrize(
    "template", ["{{ ''.__class__.__mro__ }}", "{{ messages.__class__.__base__.__subclasses__() }}"]
)
def test_the_sandbox_blocks_python_internals(permissive, template):
    with pytest.raises(InvalidRequest, match="unsafe"):
        render_text(permissive, messages=USER, chat_template_kwargs={"chat_template": template})


def test_a_template_that_blows_up_the_prompt_is_refused(permissive):
    template = "{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxx' }}{% endfor %}"
    with pytest.raises(InvalidRequest, match=f"no prompt over {permissive.max_prompt_chars} fits this model's context"):
        render_text(permissive, messages=USER, chat_template_kwargs={"chat_template": template})
    assert permissive.max_prompt_chars < 16 * 100_000


@pytest.mark.parametrize(
    ("environ", "allowed", "bound"),
    [
        ({}, False, 2.0),
        ({"PDCHAT_ALLOW_REQUEST_TEMPLATES": "1", "PDCHAT_RENDER_TIMEOUT_S": "0.5"}, True, 0.5),
        ({"PDCHAT_ALLOW_REQUEST_TEMPLATES": "Off"}, False, 2.0),
    ],
)
def test_renderer_settings(environ, allowed, bound):
    assert allow_request_templates({}, environ) is allowed
    assert render_timeout_s({}, environ) == bound


def test_a_misspelt_allow_request_templates_fails_the_load():
    with pytest.raises(ModelUnavailable, match="allow_request_templates must be one of"):
        allow_request_templates({"allow_request_templates": "maybe"}, {})


def test_messages_that_cannot_fit_the_context_are_refused_before_the_template(renderer, monkeypatch):
    request = parse_chat_json(
        json.dumps({"messages": [{"role": "user", "content": "x" * (renderer.max_prompt_chars + 1)}]})
    )
    monkeypatch.setattr(renderer, "_render_text", lambda *a: pytest.fail("the template ran"))
    with pytest.raises(InvalidRequest, match="no prompt over .* fits this model's context"):
        renderer.render(request)
