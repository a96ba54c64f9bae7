"""One caller cannot reserve decode's whole KV, and tenants share no cached prompt: an HTTP
front (in this process) before a real server whose decode pool four long choices fill."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest

from pdchat.clients.chat import GrpcChat, chat_inputs, collect
from pdchat.clients.fronts import ServerFront
from pdchat.clients.openai_api import HttpSettings
from pdchat.core.errors import ErrorCode
from tests.integration.conftest import running_server, stop_checked
from tests.integration.helpers import StreamReader, conversation, wait_for
from tests.raw_http import running_fronts

TENANT = "X-Tenant"
# decode's pool: 8 MiB of the tiny model's KV, 128 blocks of 16 tokens. Four choices of
# prompt + max_tokens = 512 tokens reserve 32 blocks each: the whole pool, where a caller
# may reserve half.
POOL_MB = "8"
CHOICE_TOKENS = 512
LONG = {"messages": [{"role": "user", "content": "Count."}], "n": 4, "ignore_eos": True, "temperature": 0}
SHORT = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, tiny_model_dir):
    env = {"PDCHAT_DECODE_KV_MB": POOL_MB, "PDCHAT_QUEUE_TIMEOUT_S": "120", "PDCHAT_DECODE_KV_SHARE": "0.5"}
    instance = running_server(tmp_path_factory, "kv-share", env=env)
    yield instance
    stop_checked(instance)


@pytest.fixture(scope="module")
def fronts(shared_server):
    """{"plain": url of a front with no tenants, "tenants": url of one with --tenant-header}."""
    with running_fronts(ServerFront(shared_server.grpc_url)) as start:
        yield {
            "plain": f"http://127.0.0.1:{start(HttpSettings())}",
            "tenants": f"http://127.0.0.1:{start(HttpSettings(tenant_header=TENANT))}",
        }


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def finished_choices(events: list) -> int:
    return sum(
        1 for event in list(events) if event != "[DONE]" and any(c.get("finish_reason") for c in event["choices"])
    )


@pytest.mark.parametrize("kind", ["plain", "tenants"])
def test_a_request_of_many_long_choices_leaves_room_for_another_caller(fronts, kind):
    """The red team's n=16 with max_tokens filling the pool: every other client waited for
    it. Its choices now reserve half the pool at most (decode_kv_share); the later ones wait
    for its own earlier ones, and another caller's request, sent meanwhile, is answered at
    once. Through a plain front each client request is one caller; through a front with
    tenants, each tenant is."""
    url = fronts[kind]
    greedy, other = ({TENANT: "greedy"}, {TENANT: "other"}) if kind == "tenants" else ({}, {})
    prompt = post(url, {**LONG, "n": 1, "max_tokens": 1}, greedy)[1]["usage"]["prompt_tokens"]
    body = {**LONG, "max_tokens": CHOICE_TOKENS - prompt}
    long = StreamReader(url, body, greedy)
    # Choices start one after another's first output: the third is queued once the second streams.
    assert wait_for(lambda: {c["index"] for e in list(long.events) if e != "[DONE]" for c in e["choices"]} >= {1})
    time.sleep(0.5)
    status, answer = post(url, SHORT, other)
    out_by_then = len(long.events)  # one event per token: the long request's tokens so far
    assert status == 200, answer
    # Two choices at once fill the caller's half, so they alone stream until one ends; the other
    # caller waiting for a choice to end would have seen nearly all four choices' tokens out.
    assert out_by_then < 2 * body["max_tokens"], "the other caller's request waited for the long request"
    long.join(300)
    assert long.status == 200 and finished_choices(long.events) == 4, long.events[-2:]
    lengths = [e["usage"]["completion_tokens"] for e in long.events if e != "[DONE]" and e.get("usage")]
    assert not lengths or lengths == [4 * body["max_tokens"]]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_hits_its_own_cached_prompt_and_never_another_tenant_s(fronts):
    """The red team guessed another client's PIN from cached_tokens. With tenants, a prompt
    one tenant sent is cached for that tenant alone."""
    url, body = fronts["tenants"], conversation()
    first = post(url, body, {TENANT: "acme"})[1]
    again = post(url, body, {TENANT: "acme"})[1]
    stranger = post(url, body, {TENANT: "globex"})[1]
    assert cached(first) == 0 and cached(again) > 0
    assert cached(stranger) == 0
    # A client's own salt cannot reach into another tenant's cache either.
    assert cached(post(url, {**body, "cache_salt": "acme"}, {TENANT: "globex"})[1]) == 0
    # Nor a null salt (the red team's: it passed as no salt, the cache shared by all, so two
    # tenants whose SDKs send `null` shared their prompts).
    nulled = {**conversation(), "cache_salt": None}
    assert cached(post(url, nulled, {TENANT: "acme"})[1]) == 0
    assert cached(post(url, nulled, {TENANT: "initech"})[1]) == 0
    assert cached(post(url, nulled, {TENANT: "acme"})[1]) > 0


def test_a_front_with_tenants_refuses_a_request_that_names_none_or_two(fronts):
    status, answer = post(fronts["tenants"], SHORT)
    assert status == 400 and answer["error"]["code"] == "missing_tenant"
    assert TENANT in answer["error"]["message"]
    assert post(fronts["tenants"], SHORT, {TENANT: "acme"})[0] == 200
    # Two of the header (a proxy that appends its own): the client must not pick the first.
    host, port = fronts["tenants"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/chat/completions")
    for name, value in (("Content-Type", "application/json"), (TENANT, "alice"), (TENANT, "mallory")):
        connection.putheader(name, value)
    payload = json.dumps(SHORT).encode()
    connection.putheader("Content-Length", str(len(payload)))
    connection.endheaders(payload)
    reply = connection.getresponse()
    assert reply.status == 400 and json.loads(reply.read())["error"]["code"] == "missing_tenant"
    connection.close()


def test_a_kv_owner_that_is_no_string_is_refused_naming_it(shared_server):
    client = GrpcChat(shared_server.grpc_url)
    outputs = client.stream(chat_inputs(SHORT), parameters={"kv_owner": 7})
    with pytest.raises(Exception, match="kv_owner") as refused:
        collect(outputs)
    assert getattr(refused.value, "code", ErrorCode.INVALID_ARG) == ErrorCode.INVALID_ARG
