"""The HTTP front's drain (`POST /drain`, or the first SIGTERM): new requests get 503
`draining` and readiness turns false at once, running streams finish within the drain
timeout, the rest end with an error event; and the front's own error answers for a stall
(504 `upstream_timeout`) and a drain. The router behind it is a stand-in: no server."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from pdchat.clients.backend_pool import Draining, UpstreamTimeout
from pdchat.clients.chat import ChatOutput, ChatStream
from pdchat.clients.fronts import RouterStats
from pdchat.clients.http_drain import may_drain
from pdchat.clients.http_errors import chat_api_error
from pdchat.clients.openai_api import HttpSettings, make_server
from pdchat.launcher import free_port
from tests.integration.helpers import StreamReader, wait_for

API_KEY = "drain-key-0c1d"
DRAIN_TIMEOUT_S = 1.0
GAP_S = 0.05  # between two chunks of a stand-in stream


class StandIn:
    """A ChatFront that streams `max_tokens` chunks GAP_S apart; `abort` ends its streams."""

    def __init__(self) -> None:
        self.stats = RouterStats()
        self.reason = ""  # why it was aborted

    async def chat(
        self, body: dict[str, Any], request_id: str = "", form: str = "request", owner: str = ""
    ) -> ChatStream:
        count = body["max_tokens"]
        for index in range(count):
            await asyncio.sleep(GAP_S)
            if self.reason:
                raise Draining(self.reason)
            finish = "length" if index == count - 1 else None
            chunk = {
                "object": "chat.completion.chunk",
                "choices": [{"delta": {"content": "x"}, "finish_reason": finish}],
            }
            yield ChatOutput("x", json.dumps(chunk), finish_reason=finish or "")

    def abort(self, reason: str) -> None:
        self.reason = reason

    async def tokenize(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        return {"count": 0, "tokens": []}

    def health(self) -> dict[str, Any]:
        return {"ok": True}


@pytest.fixture
def front():
    """(server, base URL) of a front on a stand-in router, serving in a thread."""
    port = free_port()
    server = make_server(StandIn(), "127.0.0.1", port, HttpSettings(api_key=API_KEY, drain_timeout_s=DRAIN_TIMEOUT_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started, timeout=10, interval=0.02)
    yield server, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def call(url: str, path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start_stream(url: str, max_tokens: int) -> StreamReader:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return StreamReader(url, body, {"Authorization": f"Bearer {API_KEY}"})


def drain_in_background(url: str) -> list[tuple[int, bytes]]:
    answers: list[tuple[int, bytes]] = []
    threading.Thread(target=lambda: answers.append(call(url, "/drain", {})), daemon=True).start()
    return answers


def test_a_drain_refuses_new_requests_turns_readiness_false_and_lets_running_streams_finish(front):
    server, url = front
    assert call(url, "/health")[0] == 200
    stream = start_stream(url, max_tokens=10)  # 0.5 s, within the drain timeout
    assert stream.first.wait(5)
    answers = drain_in_background(url)
    assert wait_for(lambda: server.drain.draining, timeout=2, interval=0.01)
    status, body = call(url, "/health")
    assert status == 503 and json.loads(body)["draining"] is True
    status, body = call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and json.loads(body)["error"]["code"] == "draining"
    stream.join(10)
    assert stream.events[-1] == "[DONE]" and stream.events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in event for event in stream.events[:-1])
    assert wait_for(lambda: answers, timeout=5, interval=0.02)
    assert answers == [(200, b'{"drained": true}')]
    assert server.should_exit, "a drained front stops, for its supervisor to start it again"


def test_streams_running_past_the_drain_timeout_end_with_an_error_event(front):
    server, url = front
    stream = start_stream(url, max_tokens=10_000)
    assert stream.first.wait(5)
    started = time.monotonic()
    answers = drain_in_background(url)
    stream.join(DRAIN_TIMEOUT_S + 5)
    assert DRAIN_TIMEOUT_S <= stream.ended_at - started < DRAIN_TIMEOUT_S + 2
    *_, error, done = stream.events
    assert done == "[DONE]"
    assert error["error"]["code"] == "draining" and error["error"]["type"] == "service_unavailable"
    assert "did not finish within its drain timeout of 1 s (setting drain_timeout_s)" in error["error"]["message"]
    assert wait_for(lambda: answers, timeout=5, interval=0.02) and answers[0][0] == 200


def test_drain_needs_the_api_key(front):
    server, url = front
    status, body = call(url, "/drain", {}, key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert not server.drain.draining


@pytest.mark.parametrize(
    ("api_key", "host", "allowed"),
    [
        ("k", "203.0.113.9", True),  # the guard checked the key already
        (None, "127.0.0.1", True),
        (None, "::1", True),
        (None, "203.0.113.9", False),
        (None, "10.1.2.3", False),
        (None, None, False),  # no peer address: refused
        (None, "not-an-address", False),
    ],
)
def test_without_an_api_key_only_a_client_on_this_host_may_drain(api_key, host, allowed):
    assert may_drain(api_key, host) is allowed


def test_a_draining_front_tokenizes_nothing_either(front):
    server, url = front
    stream = start_stream(url, max_tokens=10)  # the drain waits for it
    assert stream.first.wait(5)
    drain_in_background(url)
    assert wait_for(lambda: server.drain.draining, timeout=2, interval=0.01)
    status, body = call(url, "/tokenize", {"prompt": "hi"})
    assert status == 503 and json.loads(body)["error"]["code"] == "draining"
    stream.join(10)


def test_the_first_sigterm_drains_then_stops_the_server(front):
    server, url = front
    stream = start_stream(url, max_tokens=10)
    assert stream.first.wait(5)
    server.handle_exit(signal.SIGTERM, None)  # what the signal calls, in the main thread
    assert server.drain.draining and call(url, "/health")[0] == 503
    stream.join(10)
    assert stream.events[-1] == "[DONE]" and "error" not in stream.events[-2]
    assert wait_for(lambda: server.should_exit, timeout=5, interval=0.02), "the drained server did not stop"


def test_a_stall_is_a_504_upstream_timeout_and_a_drain_a_503():
    stall = chat_api_error(UpstreamTimeout("decode server d:1 sent nothing for 30 s"))
    assert stall.status == 504
    assert stall.body() == {
        "error": {
            "message": "decode server d:1 sent nothing for 30 s",
            "type": "upstream_timeout",
            "code": "upstream_timeout",
        }
    }
    drained = chat_api_error(Draining("this front is draining"))
    assert (drained.status, drained.type, drained.code) == (503, "service_unavailable", "draining")
