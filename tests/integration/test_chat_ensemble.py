"""chat_ensemble on a real tritonserver, over tritonclient gRPC and HTTP."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from pdchat.clients.chat import ChatError, chat_inputs, collect
from pdchat.core.request.protocol import parse_chat_json
from pdchat.core.request.rendering import ChatRenderer
from tests.conversations import CONVERSATIONS, chat_body
from tests.integration.helpers import ask, metric, wait_for


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """In-process renderer and model: what the server must reproduce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ChatRenderer(tiny_model_dir, tiny_model_dir.name), model


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_greedy_output_equals_transformers_generate(grpc_chat, reference, name):
    renderer, model = reference
    body = chat_body(name, max_tokens=20, temperature=0)
    result = ask(grpc_chat, body)
    ids = renderer.token_ids(parse_chat_json(json.dumps(body)))
    assert result.prompt_token_ids == ids
    expected = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids) :].tolist()
    assert result.output_token_ids == expected
    assert result.text == renderer.tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_and_whole_answers_agree(chat_client):
    whole = ask(chat_client, chat_body("multi_turn", max_tokens=12, temperature=0))
    streamed = ask(chat_client, chat_body("multi_turn", max_tokens=12, temperature=0, stream=True))
    assert len(whole.outputs) == 1 and len(streamed.outputs) == 12
    assert streamed.output_token_ids == whole.output_token_ids
    assert streamed.text == whole.text
    assert streamed.finish_reason == whole.finish_reason == "length"
    final = whole.outputs[0].response
    assert final["object"] == "chat.completion" and final["choices"][0]["message"]["content"] == whole.text
    assert final["usage"]["completion_tokens"] == 12
    chunks = [o.response for o in streamed.outputs]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == whole.text


def test_text_input_convention_of_genai_perf(chat_client):
    text = "Summarize the plot of Hamlet."
    streamed = ask(chat_client, text_input=text, max_tokens=8, stream=True, exclude_input_in_output=True)
    assert len(streamed.outputs) == 8
    echoed = ask(chat_client, text_input=text, max_tokens=8)
    # Greedy by default; without exclude_input_in_output the prompt leads the whole answer.
    assert echoed.text == text + streamed.text
    assert echoed.output_token_ids == streamed.output_token_ids


def test_stop_strings_and_return_token_ids(chat_client):
    whole = ask(chat_client, chat_body("single_turn", max_tokens=16, temperature=0))
    stop = whole.text.split()[3]
    stopped = ask(
        chat_client, chat_body("single_turn", max_tokens=16, temperature=0, stop=[stop], return_token_ids=True)
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == whole.text[: whole.text.index(stop)]
    body = stopped.outputs[-1].response
    assert body["prompt_token_ids"] == stopped.prompt_token_ids == whole.prompt_token_ids
    assert body["choices"][0]["token_ids"] == stopped.output_token_ids


def test_seeded_sampling_repeats_and_seeds_differ(grpc_chat):
    def sample(seed):
        return ask(
            grpc_chat, chat_body("single_turn", max_tokens=12, temperature=1.0, top_p=0.95, seed=seed)
        ).output_token_ids

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_concurrent_requests_each_get_their_own_answer(server, grpc_chat):
    from pdchat.clients.chat import GrpcChat

    names = ["single_turn", "system_prompt", "unicode_emoji"]
    expected = {
        n: ask(grpc_chat, chat_body(n, max_tokens=10, temperature=0, stream=True)).output_token_ids for n in names
    }
    got = {}

    def run(name):
        client = GrpcChat(server.grpc_url, "chat_ensemble")
        got[name] = ask(client, chat_body(name, max_tokens=10, temperature=0, stream=True)).output_token_ids
        client.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert got == expected


def test_client_leaving_mid_stream_cancels_decode_work(server):
    """Through `chat` (BLS), a client that stops reading cancels decode. (chat_ensemble
    cannot: Triton 2.51 ensembles do not pass cancellation to their steps.)"""
    from pdchat.clients.chat import GrpcChat

    client = GrpcChat(server.grpc_url, "chat")
    cancelled = metric(server, "pdchat_decode_requests_total", outcome="cancelled")
    stream = client.stream(chat_inputs(chat_body("single_turn", max_tokens=3000, ignore_eos=True, stream=True)))
    firsts = [next(stream) for _ in range(3)]
    stream.close()  # stop_stream(cancel_requests=True)
    assert all(o.output_token_ids for o in firsts)
    # 3000 tokens take minutes: done within the bound means cancelled.
    assert wait_for(lambda: metric(server, "pdchat_decode_active") == 0, interval=0.1)
    assert metric(server, "pdchat_decode_requests_total", outcome="cancelled") == cancelled + 1
    after = ask(client, chat_body("single_turn", max_tokens=5, temperature=0))
    assert len(after.output_token_ids) == 5
    client.close()


def test_non_decoupled_stages_answer_http_infer(server):
    client = httpclient.InferenceServerClient(server.http_url)
    request = httpclient.InferInput("request", [1], "BYTES")
    request.set_data_from_numpy(
        np.array([json.dumps(chat_body("single_turn", max_tokens=3)).encode()], dtype=np.object_)
    )
    rendered = client.infer("renderer", [request])
    ids = rendered.as_numpy("prompt_token_ids")
    params = rendered.as_numpy("generation_params")
    assert ids.dtype == np.int32 and len(ids) > 5
    assert json.loads(params[0])["max_tokens"] == 3

    prefill_inputs = [
        httpclient.InferInput("prompt_token_ids", [len(ids)], "INT32"),
        httpclient.InferInput("generation_params", [1], "BYTES"),
        httpclient.InferInput("stage_seal", [1], "BYTES"),
    ]
    prefill_inputs[0].set_data_from_numpy(ids)
    prefill_inputs[1].set_data_from_numpy(params)
    prefill_inputs[2].set_data_from_numpy(rendered.as_numpy("stage_seal"))  # the renderer's seal opens prefill
    prefilled = client.infer("prefill", prefill_inputs)
    handle = json.loads(prefilled.as_numpy("kv_handle")[0])
    assert handle["connector"] == "shm" and handle["shape"] == [4, 2, 2, len(ids), 64]
    assert handle["first_token_id"] == prefilled.as_numpy("first_token_id")[0]
    assert prefilled.as_numpy("stage_seal")[0] != rendered.as_numpy("stage_seal")[0]  # prefill's own seal opens decode
    client.close()


def user(**fields):
    return json.dumps({"messages": [{"role": "user", "content": "x"}], **fields})


BAD_REQUESTS = [
    ({"request": "{oops"}, "'request' is not valid JSON"),
    ({"request": json.dumps({"messages": []})}, "'messages' must be a non-empty list"),
    ({"request": json.dumps({"messages": [{"role": "robot", "content": "x"}]})}, "messages[0].role is 'robot'"),
    ({"request": user(max_tokens=10**9)}, "max_tokens=1000000000 does not fit"),
    ({"request": user(temperature="hot")}, "'temperature' must be a number"),
    ({"request": user(functions=[])}, "Unrecognized request argument supplied: functions"),
    ({"request": user(presence_penalty=5)}, "'presence_penalty' must be a number in [-2, 2]"),
    (
        {"request": user(logit_bias={"99999": 1})},
        "'logit_bias' names token ids outside this model's vocabulary of 49152",
    ),
    ({"request": user(model="gpt-9")}, "model 'gpt-9' is not served here"),
    ({"request": user(), "text_input": "x"}, "not both"),
    ({"request": user(), "max_tokens": 3}, "put max_tokens inside the JSON body"),
    ({"max_tokens": 3}, "one of 'request' (OpenAI chat JSON) or 'text_input' is required"),
]


@pytest.mark.parametrize(("fields", "needle"), BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(chat_client, fields, needle):
    with pytest.raises(ChatError) as info:
        collect(chat_client.stream(chat_inputs(**fields)))
    assert needle in str(info.value)
    assert ask(chat_client, chat_body("single_turn", max_tokens=2)).finish_reason == "length"


def test_wrong_tensor_type_is_refused_by_triton(grpc_chat):
    inputs = chat_inputs(text_input="hello")
    inputs["max_tokens"] = np.array([5.0], dtype=np.float32)
    with pytest.raises(ChatError, match="max_tokens"):
        collect(grpc_chat.stream(inputs))


def test_unknown_model_path_fails_its_load_clearly_and_the_rest_keeps_serving(server, grpc_chat):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from tests.integration.conftest import MISSING_MODEL_PATH

    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("prefill_bad")
    assert f"model path '{MISSING_MODEL_PATH}' is not a Hugging Face model directory" in str(info.value)
    assert not client.is_model_ready("prefill_bad")
    assert ask(grpc_chat, chat_body("single_turn", max_tokens=2)).finish_reason == "length"
    client.close()
