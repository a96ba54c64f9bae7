"""The core stages chained in-process agree with transformers' own greedy generation."""

import json
from dataclasses import replace

import pytest
import torch

from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.sampling import Choice
from pdchat.core.kv.base import tokens_from
from pdchat.core.request.protocol import parse_chat_json
from pdchat.ensemble.flow import ChatInputs
from tests.logprobs import assert_logprobs_close, logprobs_of
from tests.pipeline import LocalPipeline


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir):
    return LocalPipeline(tiny_model_dir)


def chat(**fields):
    return parse_chat_json(json.dumps({"messages": [{"role": "user", "content": "Tell me a story"}], **fields}))


def test_greedy_matches_transformers_generate(pipeline):
    outputs = pipeline.run(chat(max_tokens=24, temperature=0))
    ids = outputs[-1].prompt_token_ids
    reference = pipeline.reference_model.generate(
        torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=sorted(pipeline.model.eos_ids)
    )[0, len(ids) :].tolist()
    assert outputs[-1].output_token_ids == reference


def test_kv_handoff_equals_local_prefill_bit_for_bit(pipeline):
    request = chat(max_tokens=20, temperature=0.9, seed=11)
    handed = pipeline.run(request, handoff=True)[-1]
    local = pipeline.run(request, handoff=False)[-1]
    assert handed.output_token_ids == local.output_token_ids
    assert handed.text_output == local.text_output


def test_streamed_deltas_add_up_to_the_whole_answer(pipeline):
    whole = pipeline.run(chat(max_tokens=16, temperature=0))[-1]
    chunks = pipeline.run(chat(max_tokens=16, temperature=0, stream=True))
    assert len(chunks) == 16
    assert "".join(c.text_output for c in chunks) == whole.text_output
    assert [t for c in chunks for t in c.output_token_ids] == whole.output_token_ids
    assert [c.finish_reason for c in chunks] == [""] * 15 + ["length"]
    first = json.loads(chunks[0].response)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert "usage" not in json.loads(chunks[-1].response)  # only when asked for


def test_include_usage_adds_a_last_chunk_with_empty_choices_and_the_usage(pipeline):
    chunks = pipeline.run(chat(max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) == 7 and [c.finish_reason for c in chunks] == [""] * 6 + ["length"]
    finishing, usage = json.loads(chunks[-2].response), json.loads(chunks[-1].response)
    assert finishing["choices"][0]["finish_reason"] == "length" and "usage" not in finishing
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6 and chunks[-1].output_token_ids == []


def test_stop_string_ends_the_answer_early(pipeline):
    whole = pipeline.run(chat(max_tokens=16, temperature=0))[-1].text_output
    stop = whole.split()[2]
    stopped = pipeline.run(chat(max_tokens=16, temperature=0, stop=[stop]))[-1]
    assert stopped.finish_reason == "stop"
    assert stopped.text_output == whole[: whole.index(stop)]


def test_no_stop_string_ends_within_min_tokens_as_in_vllm(pipeline):
    plain = pipeline.run(chat(max_tokens=16, temperature=0, ignore_eos=True))[-1]
    first = pipeline.renderer.tokenizer.decode(plain.output_token_ids[:1])
    stop = first.strip()[:1]  # ends within the first token
    assert (
        pipeline.run(chat(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[-1].output_token_ids
        == (plain.output_token_ids[:1])
    )
    held = pipeline.run(chat(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop], min_tokens=3))[-1]
    assert held.output_token_ids == plain.output_token_ids[: len(held.output_token_ids)]
    assert len(held.output_token_ids) >= 3 and plain.text_output.startswith(held.text_output)
    assert stop in held.text_output[: len(first)]  # kept: it ended within min_tokens


def generation_starting_with(pipeline, first_token, **fields):
    rendered = pipeline.renderer.render(chat(temperature=0, **fields))
    kv = pipeline.model.prefill(rendered.prompt_token_ids, rendered.params).kv
    return pipeline.model.generation(
        rendered.prompt_token_ids,
        rendered.params,
        first=Choice(first_token),
        kv_source=lambda start: tokens_from(kv, start),
    )


def test_eos_ends_the_answer_unless_ignored(pipeline):
    eos = min(pipeline.model.eos_ids)
    delta = generation_starting_with(pipeline, eos, max_tokens=5).advance()
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("", [eos], "stop")
    ignoring = generation_starting_with(pipeline, eos, max_tokens=5, ignore_eos=True)
    deltas = [ignoring.advance() for _ in range(5)]
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]


@pytest.mark.parametrize("handoff", [True, False])
def test_return_token_ids_in_json_and_the_usage_counts_cached_prompt_tokens(tiny_model_dir, handoff):
    pipeline = LocalPipeline(tiny_model_dir)  # a cold prefix cache
    story = "Tell me a story about a lighthouse keeper, a cat and a storm that lasted three days."
    request = parse_chat_json(
        json.dumps({"messages": [{"role": "user", "content": story}], "max_tokens": 4, "temperature": 0})
    )
    request = replace(request, return_token_ids=True)
    cold, warm = (pipeline.run(request, handoff=handoff)[-1] for _ in range(2))
    body = json.loads(warm.response)
    assert body["prompt_token_ids"] == warm.prompt_token_ids
    assert body["choices"][0]["token_ids"] == warm.output_token_ids == cold.output_token_ids
    prompt = len(warm.prompt_token_ids)
    cached = (prompt - 1) // 16 * 16  # the full blocks before the last prompt token
    assert cached > 0 and json.loads(cold.response)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "total_tokens": prompt + 4,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"],
        },
    },
}


@pytest.mark.parametrize("handoff", [True, False])
def test_json_schema_output_is_valid_json_of_the_schema(pipeline, handoff):
    result = pipeline.run(
        chat(
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        ),
        handoff=handoff,
    )[-1]
    value = json.loads(json.loads(result.response)["choices"][0]["message"]["content"])
    assert set(value) == {"answer", "sure"} and isinstance(value["answer"], int) and isinstance(value["sure"], bool)
    assert result.finish_reason == "stop"


def test_forced_tool_choice_yields_parsed_tool_calls(pipeline):
    result = pipeline.run(chat(max_tokens=60, temperature=0, tools=[TOOL], tool_choice="required"))[-1]
    message = json.loads(result.response)["choices"][0]["message"]
    assert result.finish_reason == "tool_calls"
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "pick"
    assert set(json.loads(call["function"]["arguments"])) == {"n", "ok"}


def test_streamed_tool_call_arrives_whole_in_one_chunk(pipeline):
    chunks = [
        json.loads(c.response)
        for c in pipeline.run(chat(max_tokens=60, temperature=0, tools=[TOOL], tool_choice="required", stream=True))
    ]
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "pick"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_answer_continuing_an_open_think_block_is_reasoning(pipeline):
    request = parse_chat_json(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Plan a trip"},
                    {"role": "assistant", "content": "<think>\nFirst"},
                ],
                "continue_final_message": True,
                "max_tokens": 8,
                "temperature": 0,
            }
        )
    )
    message = json.loads(pipeline.run(request)[-1].response)["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]


# Request fields that shape the choice, through the whole pipeline (prefill picks the first
# token, decode the rest): each one changes the answer as specified.


def answer(pipeline, handoff=True, **fields):
    return pipeline.run(chat(temperature=0, **fields), handoff=handoff)[-1]


def reference_greedy(pipeline, prompt, tokens, *, bias=None, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding written out from the specification (full forward pass per token):
    logit_bias, then vLLM/HF's repetition penalty over prompt + output, then OpenAI's
    frequency and presence penalties over the output."""
    out = []
    for _ in range(tokens):
        logits = next_logits(pipeline, prompt + out)
        for token, amount in (bias or {}).items():
            logits[token] += amount
        for token in set(prompt + out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(torch.argmax(logits)))
    return out


def next_logits(pipeline, token_ids):
    with torch.inference_mode():
        logits = pipeline.reference_model(torch.tensor([token_ids])).logits[0, -1]
    return logits.clone()


PENALTIES = {
    "presence_penalty": ("presence", 2.0),
    "frequency_penalty": ("frequency", 1.5),
    "repetition_penalty": ("repetition", 1.3),
}


@pytest.mark.parametrize("field", [*PENALTIES, "encouraging_repetition"])
def test_penalties_follow_their_specification_and_change_the_answer(pipeline, field):
    prompt = answer(pipeline, max_tokens=1).prompt_token_ids
    # The 4 likeliest first tokens, biased far up, compete at every position: repeats happen and penalties bite.
    favoured = {token: 100.0 for token in torch.topk(next_logits(pipeline, prompt), 4).indices.tolist()}
    bias = {"logit_bias": {str(t): b for t, b in favoured.items()}}
    name, value = PENALTIES.get(field, ("repetition", 0.05))
    fields = {field if field in PENALTIES else "repetition_penalty": value}
    got = answer(pipeline, max_tokens=10, **bias, **fields).output_token_ids
    expected = reference_greedy(pipeline, prompt, 10, bias=favoured, **{name: value})
    assert got == expected
    assert got != answer(pipeline, max_tokens=10, **bias).output_token_ids, f"{field} changed nothing"


def test_logit_bias_bans_a_token_and_forces_one(pipeline):
    plain = answer(pipeline, max_tokens=6).output_token_ids
    banned = answer(pipeline, max_tokens=6, logit_bias={str(plain[0]): -100}).output_token_ids
    assert banned[0] != plain[0] and plain[0] not in banned
    assert answer(pipeline, max_tokens=6, logit_bias={"1234": 100}).output_token_ids == [1234] * 6


def test_top_k_one_and_min_p_one_are_greedy_where_plain_sampling_is_not(pipeline):
    greedy = answer(pipeline, max_tokens=12).output_token_ids
    sampled = {"temperature": 1.0, "seed": 3, "max_tokens": 12}
    assert pipeline.run(chat(**sampled))[-1].output_token_ids != greedy
    assert pipeline.run(chat(**sampled, top_k=1))[-1].output_token_ids == greedy
    assert pipeline.run(chat(**sampled, min_p=1.0))[-1].output_token_ids == greedy
    assert (
        pipeline.run(chat(**sampled, top_k=40, min_p=0.05))[-1].output_token_ids
        != pipeline.run(chat(**sampled))[-1].output_token_ids
    )


def test_min_tokens_holds_back_eos(pipeline):
    eos = min(pipeline.model.eos_ids)
    at_once = answer(pipeline, max_tokens=8, logit_bias={str(eos): 100})
    assert (at_once.output_token_ids, at_once.finish_reason) == ([eos], "stop")
    held = answer(pipeline, max_tokens=8, logit_bias={str(eos): 100}, min_tokens=3)
    assert len(held.output_token_ids) == 4 and held.output_token_ids[-1] == eos and eos not in held.output_token_ids[:3]
    assert held.finish_reason == "stop"
    # With ignore_eos too, as vLLM: EOS stays out of the first min_tokens tokens, then ends nothing.
    ignoring = answer(pipeline, max_tokens=8, logit_bias={str(eos): 100}, min_tokens=3, ignore_eos=True)
    assert eos not in ignoring.output_token_ids[:3] and ignoring.output_token_ids[3:] == [eos] * 5


def test_stop_token_ids_end_the_answer_without_their_text(pipeline):
    plain = answer(pipeline, max_tokens=16).output_token_ids
    cut = next(i for i in range(2, 16) if plain[i] not in plain[:i])
    for handoff in (True, False):
        stopped = answer(pipeline, handoff=handoff, max_tokens=16, stop_token_ids=[plain[cut]], ignore_eos=True)
        assert stopped.output_token_ids == plain[: cut + 1] and stopped.finish_reason == "stop"
        assert stopped.text_output == pipeline.renderer.tokenizer.decode(plain[:cut], skip_special_tokens=True)
    # min_tokens suppresses stop_token_ids too.
    held = answer(pipeline, max_tokens=16, stop_token_ids=[plain[cut]], min_tokens=cut + 1).output_token_ids
    assert len(held) > cut + 1 and held[cut] != plain[cut]


def test_logprobs_whole_and_streamed_and_with_or_without_handoff(pipeline):
    request = {"max_tokens": 8, "logprobs": True, "top_logprobs": 3}
    whole = answer(pipeline, **request)
    entries = logprobs_of([json.loads(whole.response)])
    assert len(entries) == 8 and all(len(e["top_logprobs"]) == 3 for e in entries)
    # Greedy over the raw distribution: each chosen token is its position's likeliest.
    assert all(
        e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in entries
    )
    assert bytes(b for e in entries for b in e["bytes"]).decode() == whole.text_output
    streamed = pipeline.run(chat(temperature=0, stream=True, **request))
    assert [len(logprobs_of([json.loads(c.response)])) for c in streamed] == [1] * 8
    assert_logprobs_close(logprobs_of([json.loads(c.response) for c in streamed]), entries, tolerance=0.0)
    assert_logprobs_close(logprobs_of([json.loads(answer(pipeline, handoff=False, **request).response)]), entries)
    assert "logprobs" not in json.loads(answer(pipeline, max_tokens=2).response)["choices"][0]


@pytest.mark.parametrize("handed", ["none", "fewer"])
def test_logprobs_prefill_did_not_hand_over_come_from_its_last_prompt_token_again(pipeline, handed):
    """A prefill leg that did not ask for logprobs (or for fewer alternatives): decode uses its
    KV and first token all the same, computing the prompt's last token again for the logprobs."""
    rendered = pipeline.renderer.render(chat(temperature=0, max_tokens=4, logprobs=True, top_logprobs=3))
    ids, params = rendered.prompt_token_ids, rendered.params
    prefilled = pipeline.model.prefill(ids, params)
    first, kv = prefilled.first, prefilled.kv
    given = Choice(first.token_id, None if handed == "none" else first.logprobs.trimmed(1))
    [entry] = (
        pipeline.model.generation(ids, params, first=given, kv_source=lambda start: tokens_from(kv, start))
        .advance()
        .logprobs
    )
    assert entry.token_id == first.token_id and [t for t, _ in entry.top] == [t for t, _ in first.logprobs.top]
    assert abs(entry.logprob - first.logprobs.logprob) < 1e-4
    unasked = replace(params, logprobs=False, top_logprobs=0)
    assert (
        pipeline.model.generation(ids, unasked, first=first, kv_source=lambda start: tokens_from(kv, start))
        .advance()
        .logprobs
        == []
    )


def test_logprobs_are_raw_whatever_shapes_the_choice(pipeline):
    plain = logprobs_of([json.loads(answer(pipeline, max_tokens=1, logprobs=True, top_logprobs=2).response)])
    forced = logprobs_of(
        [json.loads(answer(pipeline, max_tokens=1, logprobs=True, top_logprobs=2, logit_bias={"1234": 100}).response)]
    )
    assert forced[0]["token"] == pipeline.model.speller.spell(1234)[0] != plain[0]["token"]
    assert forced[0]["top_logprobs"] == plain[0]["top_logprobs"]  # the bias shaped the choice, not the distribution


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


class Scripted:
    """A token chooser that says a given answer, whatever the model's logits."""

    greedy = False  # not the logits' argmax

    def __init__(self, token_ids):
        self._token_ids, self._position = token_ids, 0

    def choose(self, logits, argmax=None):
        self.replay(self._token_ids[self._position])
        return Choice(self._token_ids[self._position - 1])

    def replay(self, token_id):
        self._position += 1


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_ends_the_answer_with_its_first_call(pipeline, monkeypatch, stream):
    script = pipeline.renderer.tokenizer.encode(TWO_CALLS, add_special_tokens=False) + [min(pipeline.model.eos_ids)]
    monkeypatch.setattr(pipeline.model, "chooser", lambda prompt, params: Scripted(script))

    def called(**fields):
        outputs = pipeline.run(chat(max_tokens=100, tools=[WEATHER], stream=stream, **fields))
        calls = [
            json.loads(c["function"]["arguments"])["city"] for o in outputs for c in message(o).get("tool_calls") or []
        ]
        content = "".join(message(o).get("content") or "" for o in outputs)
        return calls, content, [t for o in outputs for t in o.output_token_ids], outputs[-1].finish_reason

    assert called() == (["Paris", "Rome"], "Let me check.\n\n", script, "tool_calls")
    first_call = TWO_CALLS[: TWO_CALLS.index("</tool_call>") + len("</tool_call>")]
    ended = len(pipeline.renderer.tokenizer.encode(first_call, add_special_tokens=False))
    assert called(parallel_tool_calls=False) == (["Paris"], "Let me check.\n", script[:ended], "tool_calls")


def message(output):
    choice = json.loads(output.response)["choices"][0]
    return choice.get("message") or choice.get("delta")


def test_forced_tool_choice_already_makes_one_call_and_parallel_false_keeps_it(pipeline):
    for parallel in (True, False):
        result = pipeline.run(
            chat(max_tokens=60, temperature=0, tools=[TOOL], tool_choice="required", parallel_tool_calls=parallel)
        )[-1]
        assert (
            result.finish_reason == "tool_calls"
            and len(json.loads(result.response)["choices"][0]["message"]["tool_calls"]) == 1
        )


def test_each_row_of_a_batch_keeps_its_own_shaping_and_logprobs(pipeline):
    """The batched step hands each row's logits to its own request: penalties, biases and
    logprobs of one row never leak into another, and each answers what it would alone."""
    requests = [
        chat(temperature=0, max_tokens=8, logprobs=True, top_logprobs=2),
        chat(temperature=0, max_tokens=8, logit_bias={"1234": 100}),
        chat(temperature=0, max_tokens=8, repetition_penalty=0.05, min_tokens=8),
        chat(temperature=0.9, seed=5, max_tokens=8, top_k=20, min_p=0.01, presence_penalty=-2, logprobs=True),
    ]
    batched = pipeline.run_batched(requests)
    for request, outputs in zip(requests, batched, strict=True):
        alone = pipeline.run(request)[-1]
        assert outputs[-1].output_token_ids == alone.output_token_ids
        assert_logprobs_close(
            logprobs_of([json.loads(outputs[-1].response)]), logprobs_of([json.loads(alone.response)])
        )
    assert batched[1][-1].output_token_ids == [1234] * 8


# Prefill's first output (TextModel.first_output): a streamed answer's first chunk goes to the
# client once prefill chose the token, and decode's stream goes on after it.


def _without_identity(outputs):
    """The outputs with each chunk's id and created left out (each run makes its own)."""
    return [
        (
            o.text_output,
            o.output_token_ids,
            o.finish_reason,
            {k: v for k, v in json.loads(o.response).items() if k not in ("id", "created")},
        )
        for o in outputs
    ]


@pytest.mark.parametrize(
    ("fields", "early"),
    [
        ({}, True),
        ({"logprobs": True, "top_logprobs": 2}, True),
        ({"stop": ["@@@"]}, True),
        ({"stop": ["e"]}, False),  # its first token holds an "e": the answer ends there
        ({"stream_options": {"include_usage": True}, "return_token_ids": True}, True),
        ({"max_tokens": 1}, False),  # its first token is its last: decode sends it, with the end
    ],
)
def test_prefills_first_output_is_the_one_decode_would_send(pipeline, fields, early):
    request = chat(**{"max_tokens": 8, "temperature": 0, "stream": True, **fields})
    handed = pipeline.serve(ChatInputs(request), handoff=True)
    alone = pipeline.serve(ChatInputs(request), handoff=False)  # decode prefills: it makes every output
    assert [o.output_token_ids for o in handed.sent] == ([handed.outputs[0].output_token_ids] if early else [])
    assert _without_identity(handed.outputs) == _without_identity(alone.outputs)


def test_no_first_output_for_a_whole_answer(pipeline):
    stages = pipeline.serve(ChatInputs(chat(max_tokens=4, temperature=0)), handoff=True)
    assert stages.sent == [] and len(stages.outputs) == 1


def test_a_failed_pull_keeps_prefills_first_token(pipeline):
    """Decode computes the prompt itself when the KV pull fails; the first token stays the one
    prefill chose, which its client may have been shown already."""
    request = chat(max_tokens=3, temperature=0, logprobs=True, top_logprobs=1)
    rendered = pipeline.renderer.render(request)
    ids, params = rendered.prompt_token_ids, rendered.params
    greedy = pipeline.model.prefill(ids, params).first.token_id
    given = (greedy + 1) % pipeline.model.engine.vocab_size
    generation = pipeline.model.generation(ids, params, first=Choice(given), kv_source=lambda start: None)
    delta = generation.emit()
    assert delta.token_ids == [given]
    assert delta.logprobs[0].token_id == given  # computed here, from the prompt's logits
    generation.drop()


def test_a_first_token_the_grammar_refuses_leaves_no_kv_held(pipeline):
    """decode imported prefill's KV, then its grammar refused prefill's first token (prefill
    and decode with different grammar builds): the request fails and its blocks go back."""
    pool = pipeline.model.engine.pool
    closing_brace = pipeline.renderer.tokenizer.encode("}", add_special_tokens=False)[0]
    fields = {
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    }
    held = pool.usage().used_blocks
    with pytest.raises(InvalidRequest, match="breaks the request's output grammar"):
        generation_starting_with(pipeline, closing_brace, **fields)
    assert pool.usage().used_blocks == held
