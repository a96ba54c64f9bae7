"""vLLM's /tokenize and /detokenize bodies and answers (pdchat.core.request.tokenize)."""

from __future__ import annotations

import pytest

from pdchat.core.errors import InvalidRequest, ModelNotFound
from pdchat.core.request.protocol import chat_request_from_body
from pdchat.core.request.rendering import ChatRenderer
from pdchat.core.request.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return ChatRenderer(tiny_model_dir, ("tiny", tiny_model_dir.name))


def test_a_chat_tokenizes_to_the_ids_its_chat_completion_renders(renderer):
    for fields in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        chat = chat_request_from_body({"messages": MESSAGES, **fields})
        answer = tokenize(renderer, parse_tokenize({"messages": MESSAGES, "model": "tiny", **fields}))
        assert answer["tokens"] == renderer.render(chat).prompt_token_ids
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == renderer.context_length
        assert "token_strs" not in answer


def test_a_prompt_is_encoded_and_detokenize_round_trips(renderer):
    answer = tokenize(renderer, parse_tokenize({"prompt": "Hello there, world", "return_token_strs": True}))
    assert answer["tokens"] == renderer.tokenizer.encode("Hello there, world")
    assert answer["token_strs"] == renderer.tokenizer.convert_ids_to_tokens(answer["tokens"])
    plain = tokenize(renderer, parse_tokenize({"prompt": "Hello there, world", "add_special_tokens": False}))
    assert detokenize(renderer, parse_detokenize({"tokens": plain["tokens"]})) == {"prompt": "Hello there, world"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": MESSAGES, "max_tokens": 3}, "Unrecognized request argument supplied: max_tokens"),
        ({"prompt": "x", "tools": []}, "Unrecognized request argument supplied: tools"),
        ({"messages": MESSAGES, "add_special_tokens": True}, "'add_special_tokens' can only be false"),
        ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, "colour"),
        ({"prompt": 3}, "'prompt' must be a string"),
        ({}, "'messages' (a chat) or 'prompt'"),
    ],
)
def test_bad_tokenize_bodies_are_refused_by_name(body, needle):
    with pytest.raises(InvalidRequest) as info:
        parse_tokenize(body)
    assert needle in str(info.value)


def test_bad_detokenize_bodies_and_other_models_are_refused(renderer):
    for body in ({"tokens": [1, -2]}, {"tokens": "12"}, {"tokens": [1], "prompt": "x"}):
        with pytest.raises(InvalidRequest):
            parse_detokenize(body)
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        detokenize(renderer, parse_detokenize({"tokens": [10**7]}))
    for request in (
        parse_tokenize({"messages": MESSAGES, "model": "gpt-9"}),
        parse_tokenize({"prompt": "x", "model": "gpt-9"}),
    ):
        with pytest.raises(ModelNotFound):
            tokenize(renderer, request)
    with pytest.raises(ModelNotFound):
        detokenize(renderer, parse_detokenize({"tokens": [1], "model": "gpt-9"}))


def test_tokenize_and_detokenize_keep_the_limits_a_completion_keeps(renderer, monkeypatch):
    """The red team tokenized 3 MB through /tokenize (1.5-3 s of renderer time each) where a
    completion of the same prompt is refused at once: every route that tokenizes checks the
    prompt's size first, and detokenize takes no more ids than the context holds."""
    encoded = []
    monkeypatch.setattr(renderer.tokenizer, "encode", lambda *a, **k: encoded.append(a) or [1])
    too_long = "x" * (renderer.max_prompt_chars + 1)
    with pytest.raises(InvalidRequest, match=f"the prompt holds {len(too_long)} characters"):
        tokenize(renderer, parse_tokenize({"prompt": too_long}))
    with pytest.raises(InvalidRequest, match="the messages and tools hold"):
        tokenize(renderer, parse_tokenize({"messages": [{"role": "user", "content": too_long}]}))
    assert encoded == []  # refused before the tokenizer
    with pytest.raises(InvalidRequest, match="no text over this model's context"):
        detokenize(renderer, parse_detokenize({"tokens": [1] * (renderer.context_length + 1)}))
