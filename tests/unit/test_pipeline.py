"""The core stages chained in-process agree with transformers' own greedy generation."""

import json

import pytest
import torch

from pdchat.core.protocol import parse_chat_json
from pdchat.ensemble.pipeline import LocalPipeline


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
    assert json.loads(chunks[-1].response)["usage"]["completion_tokens"] == 16


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
