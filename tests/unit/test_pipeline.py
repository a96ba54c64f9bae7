"""The core stages chained in-process agree with transformers' own greedy generation."""

import json

import pytest
import torch

from pdchat.core.request.protocol import parse_chat_json
from tests.pipeline import LocalPipeline


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir):
    return LocalPipeline(tiny_model_dir)


def chat(**fields):
    return parse_chat_json(json.dumps({"messages": [{"role": "user", "content": "Tell me a story"}], **fields}))


def test_greedy_matches_transformers_generate(pipeline):
    outputs = pipeline.run(chat(max_tokens=24, temperature=0))
    ids = outputs[-1].prompt_token_ids
    reference = pipeline.model.engine.model.generate(
        torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=sorted(pipeline.model.eos_ids)
    )[0, len(ids):].tolist()
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


def generation_starting_with(pipeline, first_token, **fields):
    rendered = pipeline.renderer.render(chat(temperature=0, **fields))
    _, kv = pipeline.model.prefill(rendered.prompt_token_ids, rendered.params)
    return pipeline.model.generation(rendered.prompt_token_ids, rendered.params, first_token_id=first_token, kv_cache=kv)


def test_eos_ends_the_answer_unless_ignored(pipeline):
    eos = min(pipeline.model.eos_ids)
    delta = generation_starting_with(pipeline, eos, max_tokens=5).advance()
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("", [eos], "stop")
    ignoring = generation_starting_with(pipeline, eos, max_tokens=5, ignore_eos=True)
    deltas = [ignoring.advance() for _ in range(5)]
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]


def test_return_token_ids_in_json(pipeline):
    result = pipeline.run(chat(max_tokens=4, temperature=0, return_token_ids=True))[-1]
    body = json.loads(result.response)
    assert body["prompt_token_ids"] == result.prompt_token_ids
    assert body["choices"][0]["token_ids"] == result.output_token_ids
    assert body["usage"] == {"prompt_tokens": len(result.prompt_token_ids), "completion_tokens": 4, "total_tokens": len(result.prompt_token_ids) + 4}


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}}, "required": ["answer", "sure"]}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}}}


@pytest.mark.parametrize("handoff", [True, False])
def test_json_schema_output_is_valid_json_of_the_schema(pipeline, handoff):
    result = pipeline.run(chat(max_tokens=60, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}), handoff=handoff)[-1]
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
    chunks = [json.loads(c.response) for c in pipeline.run(chat(max_tokens=60, temperature=0, tools=[TOOL], tool_choice="required", stream=True))]
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "pick"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_answer_continuing_an_open_think_block_is_reasoning(pipeline):
    request = parse_chat_json(json.dumps({
        "messages": [{"role": "user", "content": "Plan a trip"}, {"role": "assistant", "content": "<think>\nFirst"}],
        "continue_final_message": True, "max_tokens": 8, "temperature": 0}))
    message = json.loads(pipeline.run(request)[-1].response)["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
