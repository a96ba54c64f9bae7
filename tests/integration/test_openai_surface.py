"""The OpenAI/vLLM surface around chat (issue 26): served model names, /tokenize,
/detokenize, /version, /v1/completions, and vLLM-named engine metrics, on a real server.

The session's decode-role server (it signs do_remote_decode itself, so a router can drive
both legs on it; conftest serves it with two names), behind in-process fronts: the P/D router and `pdchat openai`'s
ServerFront, each with the names, and a ServerFront without them (the server checks).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

import pdchat
from pdchat.clients.fronts import ServerFront
from pdchat.clients.openai_api import HttpSettings
from pdchat.clients.router import PDRouter
from pdchat.launcher import free_port
from tests.integration.conftest import SERVED_NAMES
from tests.integration.helpers import metric, wait_for
from tests.raw_http import running_fronts

NAMES = SERVED_NAMES  # the decode server's
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def fronts(decode_server):
    """{"router": port, "openai": port, "unnamed": port}: the router and ServerFront with
    the names, and a ServerFront without them."""
    url = decode_server.grpc_url
    ports = {}
    routers = {
        "router": PDRouter([url], [url], served_model_names=NAMES),
        "openai": ServerFront(url, served_model_names=NAMES),
        "unnamed": ServerFront(url),
    }
    with running_fronts(routers["router"]) as start_router, running_fronts(routers["openai"]) as start_openai:
        with running_fronts(routers["unnamed"]) as start_unnamed:
            for name, start in (("router", start_router), ("openai", start_openai), ("unnamed", start_unnamed)):
                ports[name] = start(HttpSettings())
            yield ports


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(port: int, **fields) -> tuple[int, dict]:
    return call(port, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})


@pytest.mark.parametrize("front", ["router", "openai"])
def test_every_served_name_is_answered_and_listed_and_another_is_404_model_not_found(fronts, front):
    status, models = call(fronts[front], "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == list(NAMES)
    for name in (*NAMES, None):
        status, answer = chat(fronts[front], **({} if name is None else {"model": name}))
        assert status == 200, answer
        assert answer["model"] == NAMES[0]
    status, answer = chat(fronts[front], model="gpt-9")
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_a_front_without_names_lists_the_servers_first_and_the_server_answers_404(fronts):
    status, models = call(fronts["unnamed"], "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [NAMES[0]]
    assert chat(fronts["unnamed"], model=NAMES[1])[0] == 200
    status, answer = chat(fronts["unnamed"], model="gpt-9")
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    assert f"'{NAMES[0]}', '{NAMES[1]}'" in answer["error"]["message"]


@pytest.mark.parametrize("front", ["router", "openai"])
def test_tokenize_of_a_chat_equals_the_prompt_ids_chat_computes(fronts, front):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    for fields in ({}, {"tools": tools}, {"add_generation_prompt": False}):
        status, answer = chat(fronts[front], return_token_ids=True, model=NAMES[1], **fields)
        assert status == 200, answer
        status, tokens = call(fronts[front], "POST", "/tokenize", {"messages": MESSAGES, "model": NAMES[1], **fields})
        assert status == 200, tokens
        assert tokens["tokens"] == answer["prompt_token_ids"]
        assert tokens["count"] == len(tokens["tokens"]) == answer["usage"]["prompt_tokens"]
        assert tokens["max_model_len"] > tokens["count"]


@pytest.mark.parametrize("front", ["router", "openai"])
def test_detokenize_round_trips_a_tokenized_prompt_and_version_answers(fronts, front):
    text = "Hello there, world: 42 tokens?"
    status, tokens = call(
        fronts[front], "POST", "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    )
    assert status == 200 and len(tokens["token_strs"]) == tokens["count"] > 0, tokens
    assert call(fronts[front], "POST", "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": text})
    assert call(fronts[front], "GET", "/version") == (200, {"version": pdchat.__version__})


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        (
            "/tokenize",
            {"messages": MESSAGES, "max_tokens": 3},
            400,
            "Unrecognized request argument supplied: max_tokens",
        ),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model_not_found"),
        ("/detokenize", {"tokens": [1], "colour": 1}, 400, "Unrecognized request argument supplied: colour"),
    ],
)
def test_bad_tokenizer_requests_are_refused_by_name(fronts, path, body, status, needle):
    for front in ("router", "unnamed"):
        got, answer = call(fronts[front], "POST", path, body)
        assert got == status and needle in json.dumps(answer), (front, answer)


def vllm_series(server) -> dict[str, float]:
    """Each vllm:* series of the server's metrics page, by its name and labels."""
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(vllm:\S+) (\S+)$", text, re.M)}


def test_vllm_metric_names_appear_with_sane_values_after_a_request(fronts, decode_server):
    before = metric(decode_server, "vllm:generation_tokens_total", model_name=NAMES[0])
    finished = {name: metric(decode_server, name) for name in FINISHED_REQUEST_SERIES}
    status, answer = chat(fronts["openai"], max_tokens=6, ignore_eos=True, temperature=0)
    assert status == 200, answer
    series = vllm_series(decode_server)
    names = {key.split("{")[0] for key in series}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        *FINISHED_REQUEST_SERIES,
    ):
        assert name in names, sorted(names)
    assert all(f'model_name="{NAMES[0]}"' in key and 'engine="' in key for key in series)
    # Each token counted once over the two engines: the first on prefill, the rest on decode.
    assert metric(decode_server, "vllm:generation_tokens_total", model_name=NAMES[0]) - before == 6
    assert metric(decode_server, "vllm:prompt_tokens_total") >= answer["usage"]["prompt_tokens"]
    assert metric(decode_server, "vllm:prefix_cache_queries_total") >= metric(
        decode_server, "vllm:prefix_cache_hits_total"
    )
    assert all(0 <= v <= 1 for k, v in series.items() if k.startswith("vllm:kv_cache_usage_perc"))
    assert metric(decode_server, "vllm:num_requests_running") == 0
    assert metric(decode_server, "vllm:inter_token_latency_seconds_count") >= 5
    # Per finished request, over the engines that served it (prefill's and decode's, or decode's alone):
    # the answer's 6 tokens each sampled once, its prompt seen by each, one success each.
    # NOTE: decode ends a stream just after its last response: its figures may come a moment after.
    generated = "vllm:request_generation_tokens_sum"
    assert wait_for(lambda: metric(decode_server, generated) - finished[generated] == 6, timeout=5)
    grown = {name: metric(decode_server, name) - finished[name] for name in FINISHED_REQUEST_SERIES}
    engines = grown["vllm:request_prompt_tokens_count"]
    assert engines in (1, 2), grown
    assert grown["vllm:request_success_total"] == engines
    assert grown["vllm:time_to_first_token_seconds_count"] == grown["vllm:e2e_request_latency_seconds_count"] == engines
    assert grown["vllm:request_prompt_tokens_sum"] == engines * answer["usage"]["prompt_tokens"]


FINISHED_REQUEST_SERIES = (
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_generation_tokens_sum",
)


def completion(port: int, body: dict) -> tuple[int, list[dict]]:
    """POST /v1/completions: the status and the answer, or the SSE chunks of a streamed one."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            if not body.get("stream"):
                return reply.status, [json.loads(reply.read())]
            events = [line[6:].strip() for line in reply if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", events
            return reply.status, [json.loads(event) for event in events[:-1]]
    except urllib.error.HTTPError as exc:
        return exc.code, [json.loads(exc.read())]


GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.mark.parametrize("front", ["router", "openai"])
def test_a_completion_of_a_chats_rendered_ids_equals_the_chat_answer(fronts, front):
    """The ids /tokenize gives for a chat, sent as a completions prompt: the same stages
    (through the router: prefill's signed handoff, decode reusing the ids) answer the chat's
    tokens, streamed and not."""
    status, answer = chat(fronts[front], **GREEDY)
    assert status == 200, answer
    status, tokens = call(fronts[front], "POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200 and tokens["tokens"] == answer["prompt_token_ids"], tokens
    expected_ids = answer["choices"][0]["token_ids"]
    status, [whole] = completion(fronts[front], {"prompt": tokens["tokens"], "model": NAMES[1], **GREEDY})
    assert status == 200, whole
    assert whole["object"] == "text_completion" and whole["model"] == NAMES[0]
    [choice] = whole["choices"]
    assert choice["token_ids"] == expected_ids and choice["finish_reason"] == "length"
    assert whole["usage"]["prompt_tokens"] == len(tokens["tokens"]) and whole["usage"]["completion_tokens"] == 8
    status, chunks = completion(
        fronts[front],
        {"prompt": tokens["tokens"], "stream": True, "stream_options": {"include_usage": True}, **GREEDY},
    )
    assert status == 200, chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [i for c in chunks for ch in c["choices"] for i in ch["token_ids"]] == expected_ids
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_a_text_prompt_with_echo_stop_and_logprobs(fronts):
    port = fronts["router"]
    prompt = "Once upon a time"
    status, [echoed] = completion(port, {"prompt": prompt, "echo": True, **GREEDY})
    assert status == 200, echoed
    status, [plain] = completion(port, {"prompt": prompt, "logprobs": 2, **GREEDY})
    assert status == 200, plain
    text = plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == prompt + text
    logprobs = plain["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 8
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and logprobs["text_offset"][0] == 0
    stop = text[2:5]
    status, [stopped] = completion(port, {"prompt": prompt, **GREEDY, "stop": stop, "return_token_ids": False})
    assert status == 200 and stopped["choices"][0]["finish_reason"] == "stop", stopped
    assert stop not in stopped["choices"][0]["text"] and text.startswith(stopped["choices"][0]["text"])


@pytest.mark.parametrize(
    ("front", "fields", "needle"),
    [
        ("router", {"suffix": "end"}, "'suffix' is not supported"),
        ("router", {"best_of": 3}, "'best_of' is not supported"),
        ("router", {"messages": MESSAGES}, "Unrecognized request argument supplied: messages"),
        ("router", {"prompt": [10**7]}, "outside this model's vocabulary"),
        ("router", {"prompt_token_ids": [1, 2]}, "prompt_token_ids is the router's to set"),
        # pdchat openai passes the body on: the server's gate refuses unsigned forwarded ids.
        ("openai", {"prompt_token_ids": [1, 2]}, "refused (unsigned)"),
    ],
)
def test_completion_fields_are_refused_by_name(fronts, front, fields, needle):
    status, [answer] = completion(fronts[front], {"prompt": [1, 2], "max_tokens": 2, **fields})
    assert status == 400 and needle in answer["error"]["message"], answer


def test_the_openai_clients_completions_create_works_against_the_router(fronts):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{fronts['router']}/v1", api_key="unused")
    whole = client.completions.create(model=NAMES[0], prompt="The sky is", max_tokens=5, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 5
    streamed = client.completions.create(model=NAMES[0], prompt="The sky is", max_tokens=5, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text


def computed_prompt_tokens(server) -> float:
    """Prompt tokens the server computed, by prefill or by decode (an idle decode prefills itself)."""
    return metric(server, "pdchat_prompt_tokens_computed_total")


@pytest.mark.parametrize("front", ["router", "openai"])
def test_n_choices_share_one_prefill_are_indexed_and_reproducible_by_seed(fronts, decode_server, front):
    """n=3 through the front: three choices (each seeded seed + i) whose prompt is computed
    once but for the tail after its last full block, streamed and whole, the same by seed."""
    messages = [{"role": "user", "content": f"{front}: " + "tell me about rivers and lakes, " * 12}]
    body = {"messages": messages, "n": 3, "seed": 11, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    before = computed_prompt_tokens(decode_server)
    status, answer = call(fronts[front], "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    prompt = answer["usage"]["prompt_tokens"]
    computed = computed_prompt_tokens(decode_server) - before
    assert prompt <= computed <= prompt + 2 * 16, (prompt, computed)  # choices 1 and 2: at most a block each
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == 18
    ids = [c["token_ids"] for c in answer["choices"]]
    assert len({tuple(i) for i in ids}) > 1  # sampled apart
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        f"http://127.0.0.1:{fronts[front]}/v1/chat/completions",
        data=json.dumps(stream).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        events = [line[6:].strip() for line in reply if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    streamed = {i: [] for i in range(3)}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
    assert [streamed[i] for i in range(3)] == ids  # the same seed, the same three choices
    assert chunks[-1]["usage"]["completion_tokens"] == 18 and chunks[-1]["usage"]["prompt_tokens"] == prompt


def test_n_for_completions_and_best_of_refused_by_name(fronts):
    status, [answer] = completion(fronts["router"], {"prompt": "Rivers", "n": 2, "max_tokens": 3, "seed": 5})
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1], answer
    status, [refused] = completion(fronts["router"], {"prompt": "Rivers", "n": 2, "best_of": 3})
    assert status == 400 and "'best_of' is not supported" in refused["error"]["message"]
    status, chat_refused = chat(fronts["router"], n=2, best_of=2)
    assert status == 400 and "best_of" in chat_refused["error"]["message"]
    status, too_many = chat(fronts["router"], n=17)
    assert status == 400 and "'n' must be an integer in [1, 16]" in too_many["error"]["message"]


@pytest.mark.parametrize("n", [1, 2])
def test_a_seed_of_2_64_is_refused_by_name_whatever_n(fronts, n):
    status, refused = chat(fronts["router"], n=n, seed=2**64)
    assert status == 400 and "'seed'" in refused["error"]["message"], refused


def test_a_front_named_otherwise_than_its_server_serves_its_own_names(decode_server):
    """The red team's `pdchat openai --served-model-name tiny` before a server without that
    name accepted "model": "tiny", then relayed the server's 404: the front checks its own
    names and sends the request on without `model`."""
    front = ServerFront(decode_server.grpc_url, served_model_names=("front-only",))
    with running_fronts(front) as start:
        port = start(HttpSettings())
        status, models = call(port, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["front-only"]
        status, answer = chat(port, model="front-only")
        assert status == 200 and answer["model"] == NAMES[0], answer  # the server's own name
        status, answer = call(port, "POST", "/tokenize", {"prompt": "Rivers", "model": "front-only"})
        assert status == 200 and answer["count"] > 0, answer
        assert chat(port, model=NAMES[0])[0] == 404  # not among the front's names


@pytest.mark.parametrize("names", [("front-only",), ()], ids=["named", "unnamed"])
def test_models_are_listed_only_while_a_server_is_ready(names):
    """With its own names a front listed them (200) while no server was ready: a client's
    first requests then got 503 after a "ready" model list."""
    front = ServerFront(f"127.0.0.1:{free_port()}", served_model_names=names)  # nothing listens there
    with running_fronts(front) as start:
        status, answer = call(start(HttpSettings()), "GET", "/v1/models")
    assert status == 503, answer
