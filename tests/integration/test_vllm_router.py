"""pdchat roles behind vllm-router: each server's `chat` behind `pdchat openai` (a
vLLM-compatible OpenAI API with kv_transfer_params in the JSON), vllm-router driving P/D
the way it drives vLLM: prefill with max_tokens 1 and do_remote_decode, the returned
kv_transfer_params copied into the decode request.

The workers vllm-router sees are the fronts: here two prefill and two decode fronts on the
session's decode-role server (which signs its own prefill legs), so ejecting a dead decode
worker is tested by killing its front, without four tritonservers on a 2-core machine, and
where vllm-router's `cache_aware` policy sends a conversation is counted by front (each
front's /health counts the chat requests it passed on).
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.request
import uuid

import pytest

from benchmarks.scaleout import start_front, vllm_router_command
from pdchat.launcher import free_port, start_service
from tests.conversations import PARITY_CASES
from tests.integration.conftest import at_once
from tests.integration.helpers import ask, chat_renders, metric

pytestmark = pytest.mark.skipif(
    shutil.which("vllm-router", path=f"{sys.prefix}/bin") is None, reason="vllm-router not installed"
)


@pytest.fixture(scope="module")
def deployment(decode_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-router-logs")
    fronts, started = {}, []
    names = ("prefill-a", "prefill-b", "decode-a", "decode-b")

    def start(name: str) -> None:
        fronts[name] = start_front(decode_server.grpc_url, logs / f"{name}.log")
        started.append(fronts[name][0])

    try:  # whatever started is stopped, also when a later start fails
        at_once([lambda name=name: start(name) for name in names])  # the four fronts at once
        router_port = free_port()
        command = vllm_router_command(
            [fronts["prefill-a"][1], fronts["prefill-b"][1]],
            [fronts["decode-a"][1], fronts["decode-b"][1]],
            router_port,
        ) + ["--policy", "cache_aware"]
        started.append(start_service(command, f"http://127.0.0.1:{router_port}/health", logs / "vllm-router.log"))
        yield {"url": f"http://127.0.0.1:{router_port}/v1", "fronts": fronts, "logs": logs}
    finally:  # all signalled first: they stop at once
        running = [process for process in started if process.poll() is None]
        for process in running:
            process.terminate()
        for process in running:
            process.wait(10)


def test_vllm_router_drives_a_pdchat_pair_with_the_gate_in_force(deployment, decode_server):
    from openai import OpenAI

    from pdchat.clients.chat import GrpcChat

    client = OpenAI(base_url=deployment["url"], api_key="unused")
    body = {"max_tokens": 12, "temperature": 0, **PARITY_CASES["multi_turn"]}
    [monolithic] = ask(GrpcChat(decode_server.grpc_url), body).outputs  # render path, same server
    renders = chat_renders(decode_server)
    accepted = metric(decode_server, "pdchat_forwarded_ids_total", outcome="accepted")
    stream = client.chat.completions.create(model=monolithic.response["model"], stream=True, **body)
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert content == monolithic.response["choices"][0]["message"]["content"]
    # One render (the prefill leg); the decode leg's ids passed the signed gate.
    assert chat_renders(decode_server) == renders + 1
    assert metric(decode_server, "pdchat_forwarded_ids_total", outcome="accepted") == accepted + 1


def front_requests(front_url: str) -> int:
    """Chat requests a `pdchat openai` front passed to its server."""
    return json.loads(urllib.request.urlopen(f"{front_url}/health").read())["stats"]["requests"]


def test_cache_aware_sends_a_conversations_next_turn_to_the_same_prefill_worker(deployment):
    from openai import OpenAI

    client = OpenAI(base_url=deployment["url"], api_key="unused", max_retries=0)
    prefill = {name: deployment["fronts"][name][1] for name in ("prefill-a", "prefill-b")}

    def counts() -> dict[str, int]:
        return {name: front_requests(url) for name, url in prefill.items()}

    for _ in range(3):  # three conversations: one landing twice on the same of 2 workers by chance is 1 in 8
        system = f"Session {uuid.uuid4()}. " + "You answer briefly and precisely about lighthouses. " * 20
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Why are they tall?"}]
        before = counts()
        reply = client.chat.completions.create(model="tiny-llama", max_tokens=4, temperature=0, messages=messages)
        first = counts()
        [home] = [name for name in prefill if first[name] == before[name] + 1]
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "How far does their light reach?"},
        ]
        client.chat.completions.create(model="tiny-llama", max_tokens=4, temperature=0, messages=messages)
        second = counts()
        assert second == {**first, home: first[home] + 1}, "the next turn's prefill went to the same worker"


def test_a_dead_decode_worker_is_ejected_and_new_requests_do_not_fail(deployment):
    from openai import OpenAI

    client = OpenAI(base_url=deployment["url"], api_key="unused", max_retries=0)
    process, _ = deployment["fronts"]["decode-b"]
    process.kill()
    process.wait()
    errors = []
    for i in range(12):
        try:
            reply = client.chat.completions.create(
                model="tiny-llama", max_tokens=3, temperature=0, messages=[{"role": "user", "content": f"request {i}"}]
            )
            assert reply.choices[0].finish_reason == "length"
        except Exception as exc:  # noqa: BLE001 - counted, then asserted
            errors.append(repr(exc))
    assert errors == []
