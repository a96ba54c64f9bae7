"""The router's HTTP front under hostile clients: real servers, real router, raw sockets.

A router process (`pdchat router`, default limits) takes the requests that need no
special settings; fronts with an API key or tight limits run in-process on free ports,
pointed at the same server. Each hostile request is followed by a normal
chat, which must still be answered.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdchat.clients.openai_api import HttpSettings
from pdchat.clients.router import PDRouter
from pdchat.launcher import PDStack, resident_bytes
from tests.integration.helpers import StreamReader, metric, wait_for
from tests.raw_http import error_of, exchange, one_reply, read_to_end, request, running_fronts

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
API_KEY = "test-key-5b1c"
TIGHT = HttpSettings(header_timeout_s=2.0, body_timeout_s=3.0, keep_alive_s=1.0)


@pytest.fixture(scope="module")
def stack(decode_server, tmp_path_factory):
    """A router process (`pdchat router`, default limits) in front of the session's decode-role
    server, which answers the prefill legs too (it signs do_remote_decode itself)."""
    instance = PDStack(prefill=decode_server, decode=decode_server)
    instance.start_router(tmp_path_factory.mktemp("http-front-logs") / "router.log")
    yield instance
    instance.stop_router()


@pytest.fixture(scope="module")
def fronts(stack):
    """start(settings) -> port of an in-process front on the stack's servers."""
    with running_fronts(PDRouter([stack.prefill.grpc_url], [stack.decode.grpc_url])) as start:
        yield start


@pytest.fixture(scope="module")
def router_port(stack) -> int:
    return stack.router_port


def assert_serves(port: int, headers: tuple[bytes, ...] = ()) -> None:
    status, reply_headers, body = one_reply(
        exchange(port, request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), headers))
    )
    assert status == 200, body
    assert json.loads(body)["choices"][0]["finish_reason"]
    assert reply_headers["X-Request-Id"].startswith("pdchat-")


def test_chunked_body_is_read_as_chunked_and_a_request_inside_gets_no_answer(router_port):
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    body = f"{len(smuggled):x}\r\n".encode() + smuggled + b"\r\n0\r\n\r\n"
    data = exchange(
        router_port, request("POST", "/v1/chat/completions", body, (b"Transfer-Encoding: chunked",), length=False)
    )
    assert data.count(b"HTTP/1.1 ") == 1
    status, _, reply = one_reply(data)
    assert status == 400 and error_of(reply)["code"] == "invalid_json"
    assert_serves(router_port)


def test_both_framings_at_once_are_refused(router_port):
    data = request(
        "POST",
        "/v1/chat/completions",
        b"4\r\n{}{}\r\n0\r\n\r\n",
        (b"Transfer-Encoding: chunked", b"Content-Length: 4"),
        length=False,
    )
    status, headers, reply = one_reply(exchange(router_port, data))
    assert status == 400 and error_of(reply)["code"] == "ambiguous_framing"
    assert headers["Connection"] == "close"
    assert_serves(router_port)


def test_negative_content_length_is_a_prompt_400(router_port):
    started = time.monotonic()
    status, _, _ = one_reply(
        exchange(router_port, request("POST", "/v1/chat/completions", headers=(b"Content-Length: -1",)), timeout=3)
    )
    assert status == 400 and time.monotonic() - started < 2
    assert_serves(router_port)


def test_terabyte_content_length_is_a_prompt_413_without_buffering(stack, router_port):
    rss = resident_bytes([stack.router.pid])[stack.router.pid]
    started = time.monotonic()
    status, headers, reply = one_reply(
        exchange(
            router_port, request("POST", "/v1/chat/completions", headers=(b"Content-Length: 1000000000000",)), timeout=3
        )
    )
    assert status == 413 and error_of(reply)["code"] == "body_too_large"
    assert headers["Connection"] == "close" and time.monotonic() - started < 2
    assert resident_bytes([stack.router.pid])[stack.router.pid] < rss + (32 << 20)
    assert_serves(router_port)


def test_chunked_body_over_the_limit_is_cut_off_at_the_limit(fronts):
    """Chunks sent one by one until the answer comes: it must come at the limit, not at the end.
    (The client stops sending then: data the server never reads would turn its close into a reset.)"""
    port = fronts(HttpSettings(max_body_bytes=64 * 1024))
    chunk = b"x" * 16384
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request("POST", "/v1/chat/completions", headers=(b"Transfer-Encoding: chunked",)))
        sent = 0
        while sent < 64 and not select.select([sock], [], [], 0.2)[0]:
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += 1
        status, _, reply = one_reply(read_to_end(sock))
    assert status == 413 and "65536 bytes" in error_of(reply)["message"]
    assert sent == 5  # the first chunk past 64 KiB
    assert_serves(port)


def test_100k_deep_json_is_a_400_naming_depth(router_port):
    body = b"[" * 100_000 + b"]" * 100_000
    status, _, reply = one_reply(exchange(router_port, request("POST", "/v1/chat/completions", body)))
    error = error_of(reply)
    assert status == 400 and error["code"] == "json_too_deep" and "depth of 64" in error["message"]
    assert_serves(router_port)


def test_non_utf8_body_is_a_400(router_port):
    status, _, reply = one_reply(
        exchange(router_port, request("POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}'))
    )
    assert status == 400 and error_of(reply)["code"] == "invalid_json"
    assert_serves(router_port)


def test_slow_and_silent_clients_are_closed_at_their_deadlines(fronts):
    """Slowloris (a head byte a second), a silent connection, a body byte a second, an idle
    kept-alive connection: each closed (the body answered 408) when its own deadline passes, none before."""
    settings = TIGHT
    port = fronts(settings)
    sockets = {
        name: socket.create_connection(("127.0.0.1", port), timeout=5) for name in ("head", "silent", "body", "idle")
    }
    started = time.monotonic()
    sockets["head"].sendall(b"GET /health HTTP/1.1\r\n")
    sockets["body"].sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
    sockets["idle"].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    health = http.client.HTTPResponse(sockets["idle"])
    health.begin()
    assert health.status == 200 and json.loads(health.read())["ok"]
    answered = time.monotonic()
    closed: dict[str, float] = {}
    dribble = {"head": iter([bytes([b]) for b in b"X-Slow: " + b"a" * 60]), "body": iter([b" "] * 60)}
    dribbled = 0.0  # when the dribbling sockets last sent their byte (one a second)
    while len(closed) < len(sockets) and time.monotonic() - started < 10:
        now = time.monotonic()
        drip, dribbled = (True, now) if now - dribbled >= 1.0 else (False, dribbled)
        for name, sock in sockets.items():
            if name in closed:
                continue
            try:
                if drip and name in dribble:
                    sock.sendall(next(dribble[name]))
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) in (b"", b"H"):  # closed, or answered
                    closed[name] = time.monotonic()
            except BlockingIOError:
                pass
            except OSError:  # reset or broken pipe: closed too
                closed[name] = time.monotonic()
        time.sleep(0.2)  # closes are seen within 0.2 s, not within the dribble's second
    status, _, reply = one_reply(read_to_end(sockets["body"]))
    assert status == 408 and error_of(reply)["code"] == "body_timeout"
    for sock in sockets.values():
        sock.close()
    deadlines = {
        "head": (started, settings.header_timeout_s),
        "silent": (started, settings.header_timeout_s),
        "body": (started, settings.body_timeout_s),
        "idle": (answered, settings.keep_alive_s),
    }
    for name, (since, timeout) in deadlines.items():
        assert name in closed, f"{name}: still open after 10 s"
        # late by up to 3 s: the close is timed on a loaded 2-core host, seen by a 0.2 s poll
        assert timeout - 0.5 <= closed[name] - since <= timeout + 3, (
            f"{name}: closed after {closed[name] - since:.1f} s"
        )
    assert_serves(port)


@pytest.mark.parametrize("value", [b"r" * 200, b"\xff\xfe\x80binary"], ids=["long", "binary"])
def test_unfit_request_id_is_a_400_naming_the_header_and_never_logged(stack, router_port, value):
    status, headers, reply = one_reply(
        exchange(
            router_port,
            request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), (b"X-Request-Id: " + value,)),
        )
    )
    error = error_of(reply)
    assert status == 400 and error["code"] == "invalid_request_id" and "X-Request-Id" in error["message"]
    assert headers["X-Request-Id"].startswith("pdchat-")
    assert value not in stack.router_log.read_bytes()
    assert_serves(router_port)


@pytest.mark.parametrize("piece", [None, 4096], ids=["at-once", "in-pieces"])
def test_60kb_request_id_is_a_400_and_never_logged(stack, router_port, piece):
    """In pieces, h11 refuses the head once it outgrows its buffer; whole, the front refuses it."""
    data = request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), (b"X-Request-Id: " + b"r" * 60_000,))
    with socket.create_connection(("127.0.0.1", router_port), timeout=10) as sock:
        for start in range(0, len(data), piece or len(data)):
            sock.sendall(data[start : start + (piece or len(data))])
            if select.select([sock], [], [], 0.05)[0]:
                break  # answered: what follows would only be reset
        status, _, _ = one_reply(read_to_end(sock))
    assert status == 400
    assert b"r" * 1000 not in stack.router_log.read_bytes()
    assert_serves(router_port)


def test_headers_over_the_limit_arriving_whole_are_refused_by_the_front(fronts):
    port = fronts(HttpSettings(max_header_bytes=2048))
    status, _, reply = one_reply(exchange(port, request("GET", "/health", headers=(b"X-Padding: " + b"p" * 3000,))))
    assert status == 400 and error_of(reply)["code"] == "headers_too_large"
    assert_serves(port)


def test_plain_request_id_is_echoed(router_port):
    data = request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), (b"X-Request-Id: trace.me:7f3a-1",))
    status, headers, _ = one_reply(exchange(router_port, data))
    assert status == 200 and headers["X-Request-Id"] == "trace.me:7f3a-1"


def test_api_key_is_required_except_on_health_and_metrics(fronts):
    port = fronts(HttpSettings(api_key=API_KEY))
    chat = json.dumps(CHAT).encode()
    for headers in [(), (b"Authorization: Bearer wrong-key",), (f"Authorization: Basic {API_KEY}".encode(),)]:
        status, reply_headers, reply = one_reply(exchange(port, request("POST", "/v1/chat/completions", chat, headers)))
        assert status == 401 and error_of(reply) == {
            "message": error_of(reply)["message"],
            "type": "authentication_error",
            "code": "invalid_api_key",
        }
        assert API_KEY not in error_of(reply)["message"] and reply_headers["X-Request-Id"]
    status, _, _ = one_reply(exchange(port, request("GET", "/v1/models")))
    assert status == 401
    for path in ("/health", "/metrics"):
        assert one_reply(exchange(port, request("GET", path)))[0] == 200
    assert_serves(port, (f"Authorization: Bearer {API_KEY}".encode(),))


def test_connections_over_the_cap_get_503(fronts):
    port = fronts(HttpSettings(max_connections=3))
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    time.sleep(0.2)
    status, _, _ = one_reply(exchange(port, request("GET", "/health")))
    assert status == 503
    for sock in held:
        sock.close()
    time.sleep(0.2)
    assert_serves(port)


def test_unknown_route_and_wrong_method_answer_in_openai_shape(router_port):
    status, _, reply = one_reply(exchange(router_port, request("GET", "/v1/nothing")))
    assert status == 404 and error_of(reply)["code"] == "not_found"
    status, headers, reply = one_reply(exchange(router_port, request("GET", "/v1/chat/completions")))
    assert status == 405 and error_of(reply)["code"] == "method_not_allowed" and headers["Allow"] == "POST"


def scrape(base_url: str) -> dict[str, float]:
    """Each sample of the router's /metrics as 'name{labels}' -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    return {
        f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_a_streamed_request_and_a_refused_one(stack, router_port):
    before = scrape(stack.router_url)
    assert one_reply(exchange(router_port, request("POST", "/v1/chat/completions", b"not json")))[0] == 400
    streamed = urllib.request.Request(
        f"{stack.router_url}/v1/chat/completions",
        data=json.dumps({**CHAT, "max_tokens": 4, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(streamed, timeout=60) as reply:
        events = [line for line in reply if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]\n" and len(events) >= 3
    after = scrape(stack.router_url)
    assert after["pdchat_router_ttft_seconds_count"] == before["pdchat_router_ttft_seconds_count"] + 1
    assert after["pdchat_router_inter_token_seconds_count"] > before["pdchat_router_inter_token_seconds_count"]
    for outcome in ("ok", "client_error"):
        key = f'pdchat_router_requests_total{{"outcome": "{outcome}"}}'
        assert after[key] == before[key] + 1
    invalid_json = 'pdchat_router_errors_total{"code": "invalid_json", "status": "400"}'
    assert after[invalid_json] == before.get(invalid_json, 0) + 1
    assert after["pdchat_router_requests_in_flight"] == 0
    assert "pdchat_router_prefill_fallbacks_total" in after


def test_client_leaving_mid_stream_cancels_decode_and_counts_as_cancelled(stack, router_port):
    cancelled = 'pdchat_router_requests_total{"outcome": "cancelled"}'
    before = scrape(stack.router_url)[cancelled]
    body = json.dumps({**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", router_port), timeout=30) as sock:
        sock.sendall(request("POST", "/v1/chat/completions", body))
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
    assert wait_for(lambda: scrape(stack.router_url)[cancelled] == before + 1, timeout=30)
    assert wait_for(lambda: metric(stack.decode, "pdchat_decode_active") == 0, timeout=30)
    assert scrape(stack.router_url)["pdchat_router_requests_in_flight"] == 0
    assert_serves(router_port)


def failed_of(stack) -> int:
    return json.loads(urllib.request.urlopen(f"{stack.router_url}/health", timeout=10).read())["stats"]["failed"]


def whole_answer(stack, body: dict, headers: dict[str, str]) -> dict:
    posted = urllib.request.Request(
        f"{stack.router_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(posted, timeout=120) as reply:
        return json.loads(reply.read())


def test_client_leaving_a_whole_answer_cancels_it_and_no_other(stack, router_port):
    """Nothing comes back before a whole answer's end: the front notices the client leave.
    It cancels that request alone, whatever ids the requests carry (every generated id
    starts "pdchat-"; a client may send any, also another's)."""
    cancelled = 'pdchat_router_requests_total{"outcome": "cancelled"}'
    unavailable = 'pdchat_router_errors_total{"code": "UNAVAILABLE", "status": "503"}'
    before, failed = scrape(stack.router_url), failed_of(stack)
    victim_body = {**CHAT, "max_tokens": 300, "ignore_eos": True}
    body = json.dumps({**CHAT, "max_tokens": 3000, "ignore_eos": True}).encode()
    with ThreadPoolExecutor(2) as pool:
        victims = [pool.submit(whole_answer, stack, victim_body, h) for h in ({}, {"X-Request-Id": "pdchat"})]
        with socket.create_connection(("127.0.0.1", router_port), timeout=30) as sock:
            sock.sendall(request("POST", "/v1/chat/completions", body, (b"X-Request-Id: pdchat",)))
            assert wait_for(lambda: metric(stack.decode, "pdchat_decode_active") == 3, timeout=30)
        left = time.monotonic()
        for victim in victims:
            assert victim.result(timeout=120)["choices"][0]["finish_reason"] == "length"
    # 3000 tokens take far longer than this
    assert wait_for(lambda: metric(stack.decode, "pdchat_decode_active") == 0, timeout=10)
    assert time.monotonic() - left < 30
    after = scrape(stack.router_url)
    assert after[cancelled] == before[cancelled] + 1
    assert after["pdchat_router_requests_in_flight"] == 0
    assert after.get(unavailable, 0) == before.get(unavailable, 0), "a client that left counted as an error"
    assert failed_of(stack) == failed, "a client that left counted as a failure"
    assert_serves(router_port)


CONCURRENT_STREAMS = 32
THREAD_SLACK = 2  # threads gRPC's core may start or end of its own accord


def threads_of(pid: int) -> int:
    """The threads of process `pid`, Python's and native ones."""
    return len(os.listdir(f"/proc/{pid}/task"))


def test_concurrent_streams_leave_the_front_s_thread_count_flat(stack, router_port):
    """A stream's outputs are taken on the front's event loop, from the route to its gRPC
    stream: 32 streams at once start no thread in the router process, and leave none."""
    pid = stack.router.pid
    assert_serves(router_port)  # the streams' loop, its channel and gRPC's own threads are up
    before = peak = threads_of(pid)

    def sampled(done) -> bool:
        nonlocal peak
        peak = max(peak, threads_of(pid))
        return done()

    body = {**CHAT, "max_tokens": 200, "ignore_eos": True}
    readers = [StreamReader(stack.router_url, body) for _ in range(CONCURRENT_STREAMS)]
    assert wait_for(lambda: sampled(lambda: all(r.first.is_set() for r in readers)), timeout=120, interval=0.01)
    assert scrape(stack.router_url)["pdchat_router_requests_in_flight"] == CONCURRENT_STREAMS, "not all at once"
    assert wait_for(lambda: sampled(lambda: not any(r.is_alive() for r in readers)), timeout=300, interval=0.01)
    assert all(r.status == 200 and r.events[-1] == "[DONE]" and len(r.events) > 200 for r in readers)
    after = threads_of(pid)
    assert peak <= before + THREAD_SLACK and after <= before + THREAD_SLACK, f"{before} -> {peak} -> {after}"


def test_openai_client_streams_through_the_front_with_its_api_key(fronts):
    from openai import AuthenticationError, OpenAI

    port = fronts(HttpSettings(api_key=API_KEY))
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
    [model] = [m.id for m in client.models.list().data]
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
