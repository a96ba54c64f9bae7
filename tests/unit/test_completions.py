"""The completions API (/v1/completions): bodies parsed and refused by name, prompts rendered
without a chat template, answers in the completions shape (pdchat.core.request.protocol,
rendering, pdchat.core.output.responses)."""

from __future__ import annotations

import json

import pytest

from pdchat.core.errors import InvalidRequest
from pdchat.core.output.logprobs import TokenLogprobs, TokenSpeller
from pdchat.core.output.parsing import OutputParser
from pdchat.core.output.responses import CompletionAssembler, Delta, response_assembler
from pdchat.core.request.protocol import completion_request_from_body, parse_completion_json
from pdchat.core.request.rendering import ChatRenderer
from pdchat.ensemble.handoff import render_fingerprint

# What `vllm bench serve --backend openai` sends (vllm/benchmarks/lib/endpoint_request_func.py).
VLLM_BENCH_BODY = {
    "model": "tiny",
    "prompt": "Hello there",
    "repetition_penalty": 1.0,
    "max_tokens": 16,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


def test_a_text_or_token_prompt_parses_with_the_sampling_fields_chat_takes():
    request = completion_request_from_body(VLLM_BENCH_BODY)
    assert request.completion and request.prompt == "Hello there" and request.messages == []
    assert (request.max_tokens, request.stream, request.include_usage, request.ignore_eos) == (16, True, True, True)
    assert not request.logprobs and not request.echo
    ids = completion_request_from_body({"prompt": [1, 2, 3], "temperature": 0, "stop": "x", "seed": 7})
    assert ids.prompt == [1, 2, 3] and ids.temperature == 0.0 and ids.stop == ("x",) and ids.seed == 7
    assert completion_request_from_body({"prompt": [[4, 5]]}).prompt == [4, 5]  # a batch of one
    assert completion_request_from_body({"prompt": ["text"]}).prompt == "text"
    assert parse_completion_json(json.dumps({"prompt": "x", "suffix": None, "best_of": None})).prompt == "x"


def test_logprobs_is_the_number_of_alternatives_and_echo_is_a_flag():
    request = completion_request_from_body({"prompt": "x", "logprobs": 3})
    assert request.logprobs and request.top_logprobs == 3
    chosen_only = completion_request_from_body({"prompt": "x", "logprobs": 0})
    assert chosen_only.logprobs and chosen_only.top_logprobs == 0
    assert completion_request_from_body({"prompt": "x", "echo": True}).echo


def test_stop_takes_up_to_64_strings():
    """decode searches each stop string at every token in its batch loop: 100,000 of them
    (a 1.2 MB body, accepted before) cost 13 ms per token, slowing every sequence beside."""
    stops = [f"s{i}" for i in range(64)]
    assert completion_request_from_body({"prompt": "x", "stop": stops}).stop == tuple(stops)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"suffix": "after"}, "'suffix' is not supported"),
        ({"best_of": 2}, "'best_of' is not supported"),
        ({"messages": [{"role": "user", "content": "x"}]}, "Unrecognized request argument supplied: messages"),
        ({"tools": []}, "Unrecognized request argument supplied: tools"),
        ({"top_logprobs": 2}, "Unrecognized request argument supplied: top_logprobs"),
        ({"logprobs": True}, "'logprobs' must be an integer in [0, 20]"),
        ({"logprobs": 21}, "'logprobs' must be an integer in [0, 20]"),
        ({"echo": True, "logprobs": 1}, "'echo' with 'logprobs'"),
        ({"n": 2}, "'n' must be 1"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"prompt": []}, "'prompt' must be a non-empty string"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": [1, -2]}, "list of token ids"),
        ({"prompt": [1, True]}, "list of token ids"),
        ({"max_tokens": 0}, "'max_tokens' must be a positive integer"),
        ({"skip_special_tokens": False}, "'skip_special_tokens' can only be true"),
        ({"stop": [f"s{i}" for i in range(65)]}, "'stop' holds 65 strings; at most 64"),
    ],
)
def test_fields_are_refused_by_name(fields, needle):
    with pytest.raises(InvalidRequest) as refused:
        completion_request_from_body({"prompt": "x", **fields})
    assert needle in str(refused.value)


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return ChatRenderer(tiny_model_dir, "tiny")


def test_a_prompt_renders_without_the_chat_template_and_token_ids_as_they_are(renderer):
    text = completion_request_from_body({"prompt": "Hello there", "max_tokens": 2})
    rendered = renderer.render(text)
    assert rendered.prompt_token_ids == renderer.tokenizer.encode("Hello there")
    assert rendered.params.completion and rendered.params.request_id.startswith("cmpl-")
    ids = renderer.render(completion_request_from_body({"prompt": [5, 6, 7]}))
    assert ids.prompt_token_ids == [5, 6, 7]
    for prompt, needle in (
        ([len(renderer.tokenizer)], "outside this model's vocabulary"),
        ([1] * renderer.context_length, "leaves no room"),
        ("x" * (renderer.max_prompt_chars + 1), "^the prompt holds"),
    ):
        with pytest.raises(InvalidRequest, match=needle):
            renderer.render(completion_request_from_body({"prompt": prompt}))


def test_the_prompt_is_part_of_the_gates_fingerprint():
    prints = {
        render_fingerprint(completion_request_from_body({"prompt": prompt}), "tiny") for prompt in ("a", "b", [1], [2])
    }
    assert len(prints) == 4


class _Tokenizer:
    """Token i spells 'w<i> '; no byte-level decoder, so TokenSpeller decodes each alone."""

    def convert_ids_to_tokens(self, ids):
        return f"w{ids} "

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"w{i} " for i in ids)


def _assembler(**fields) -> CompletionAssembler:
    request = completion_request_from_body({"prompt": [1, 2], **fields})
    params = request.generation_params(2, 100, 1000, "tiny")
    assembler = response_assembler(
        params, [1, 2], OutputParser(reasoning=True, tools=False), TokenSpeller(_Tokenizer())
    )
    assert isinstance(assembler, CompletionAssembler)
    return assembler


def _delta(token: int, finish: str | None = None) -> Delta:
    return Delta(f"w{token} ", [token], finish, [TokenLogprobs(token, -0.5, ((token, -0.5), (9, -1.5)))])


def test_a_whole_answer_is_a_text_completion_with_echo_and_usage():
    assembler = _assembler(echo=True, return_token_ids=True)
    assert assembler.on_delta(_delta(3)) == []
    [output] = assembler.on_delta(_delta(4, "length"))
    body = json.loads(output.response)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": "w1 w2 w3 w4 ", "logprobs": None, "finish_reason": "length", "token_ids": [3, 4]}
    ]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 2
    assert output.text_output == "w1 w2 w3 w4 "


def test_logprobs_take_the_completions_shape_streamed_and_whole():
    whole = _assembler(logprobs=1)
    whole.on_delta(_delta(3))
    [output] = whole.on_delta(_delta(4, "stop"))
    expected = {
        "tokens": ["w3 ", "w4 "],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"w3 ": -0.5, "w9 ": -1.5}, {"w4 ": -0.5, "w9 ": -1.5}],
        "text_offset": [0, 3],
    }
    assert json.loads(output.response)["choices"][0]["logprobs"] == expected
    streamed = _assembler(logprobs=1, stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(o.response) for d in (_delta(3), _delta(4, "stop")) for o in streamed.on_delta(d)]
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:2]] == [[0], [3]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:2]] == [None, "stop"]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2


def test_a_streamed_echo_comes_before_the_first_token():
    assembler = _assembler(echo=True, stream=True)
    texts = [
        json.loads(o.response)["choices"][0]["text"]
        for d in (_delta(3), _delta(4, "stop"))
        for o in assembler.on_delta(d)
    ]
    assert texts == ["w1 w2 w3 ", "w4 "]
