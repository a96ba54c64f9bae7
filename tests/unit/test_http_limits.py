"""The HTTP front's limits: its pure checks (JSON nesting depth, the X-Request-Id rule), and
what a real front, over a router with no servers behind it, answers to raw sockets."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from pdchat.clients.chat import ChatError, ChatOutput, ChatStream
from pdchat.clients.http_body import JsonTooDeep, json_depth, parse_json_body
from pdchat.clients.http_errors import ApiError, chat_api_error
from pdchat.clients.http_limits import HttpSettings, request_id_of
from pdchat.core.errors import ErrorCode
from tests.raw_http import error_of, exchange, one_reply, read_to_end, request, running_fronts


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("{}", 1),
        ("12", 0),
        ('{"messages": [{"role": "user", "content": "hi"}]}', 3),
        ('{"content": "[[[{{{ brackets in a string do not nest"}', 1),
        ('{"content": "an escaped quote \\" then [[[ still in the string"}', 1),
        ('{"content": "a backslash at the end \\\\"}', 1),
        ("[[], [[]], []]", 3),
    ],
)
def test_json_depth_counts_structure_not_string_contents(text, depth):
    assert json_depth(text.encode()) == depth


def test_json_depth_of_an_unterminated_string_stops_at_it():
    assert json_depth(b'[["unterminated [[[[[[') == 2


def test_100k_deep_json_is_refused_without_recursion_and_fast():
    data = b"[" * 100_000 + b"]" * 100_000
    started = time.perf_counter()
    with pytest.raises(JsonTooDeep, match="depth of 64"):
        parse_json_body(data, 64)
    assert time.perf_counter() - started < 1.0


def test_escape_dense_strings_take_linear_time():
    """A string of 2M escaped quotes that never ends: a backtracking scan would be quadratic."""
    started = time.perf_counter()
    assert json_depth(b'{"a": "' + b'\\"' * 2_000_000) == 1
    assert time.perf_counter() - started < 2.0


def test_depth_at_the_limit_parses():
    body = parse_json_body(json.dumps({"a": [[[1]]]}).encode(), 4)
    assert body == {"a": [[[1]]]}


@pytest.mark.parametrize("data", [b"[1, 2]", b'"text"', b"{", b"\xff\xfe{}", b""])
def test_bodies_that_are_not_json_objects_are_value_errors(data):
    with pytest.raises(ValueError):
        parse_json_body(data, 64)


@pytest.mark.parametrize("value", [b"trace-me-7f3a", b"a", b"A.b_c:d-9", b"x" * 128])
def test_plain_request_ids_are_kept(value):
    assert request_id_of(value) == value.decode()


@pytest.mark.parametrize("value", [b"", b"x" * 129, b"has space", b"caf\xc3\xa9", b"\xff\xfe", b"a\nb", b"a/b", b"%41"])
def test_unfit_request_ids_are_refused_without_echoing_them(value):
    with pytest.raises(ValueError, match="X-Request-Id") as info:
        request_id_of(value)
    assert f"{len(value)} bytes" in str(info.value)
    if value:
        assert value.decode("latin-1") not in str(info.value)


def test_absent_request_id_is_generated():
    first, second = request_id_of(None), request_id_of(None)
    assert first.startswith("pdchat-") and first != second
    assert request_id_of(first.encode()) == first  # a generated id passes the rule


@pytest.mark.parametrize(
    ("code", "http", "name"),
    [
        (ErrorCode.INVALID_ARG, 400, "INVALID_ARGUMENT"),
        (ErrorCode.NOT_FOUND, 404, "model_not_found"),
        (ErrorCode.UNAVAILABLE, 503, "UNAVAILABLE"),
        (ErrorCode.INTERNAL, 500, "INTERNAL"),
    ],
)
def test_router_errors_map_to_http_statuses(code, http, name):
    error = chat_api_error(ChatError("reason", code))
    assert error.status == http
    assert error.body() == {"error": {"message": "reason", "type": error.type, "code": name}}


def test_a_router_error_of_no_known_code_is_a_500():
    error = chat_api_error(ChatError("reason"))
    assert error.status == 500
    assert error.body() == {"error": {"message": "reason", "type": "server_error", "code": "INTERNAL"}}


def test_error_types_follow_openai():
    assert ApiError(401, "m", "invalid_api_key").type == "authentication_error"
    assert ApiError(413, "m", "body_too_large").type == "invalid_request_error"
    assert ApiError(503, "m", "UNAVAILABLE").type == "service_unavailable"
    assert ApiError(500, "m", "INTERNAL").type == "server_error"
    types = ["invalid_request_error", "invalid_request_error", "service_unavailable", "server_error"]
    assert [ApiError.of(code, "m").type for code in ErrorCode] == types


class _Router:
    """A ChatFront with no servers: every chat is answered at once."""

    stats = SimpleNamespace(prefill_fallbacks=0)

    async def chat(self, body: dict, request_id: str = "", form: str = "request", owner: str = "") -> ChatStream:
        yield ChatOutput("hi", json.dumps({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}))

    def health(self) -> dict:
        return {"ok": True}


@pytest.fixture(scope="module")
def fronts() -> Iterator[Callable[[HttpSettings], int]]:
    """start(settings) -> the port of a front on its own thread."""
    with running_fronts(_Router()) as start:
        yield start


BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def port(fronts) -> int:
    """A front with default limits but a short body timeout."""
    return fronts(HttpSettings(body_timeout_s=BODY_TIMEOUT_S))


CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
CHUNKED = b"Transfer-Encoding: chunked\r\n\r\n"


def assert_serves(port: int) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, reply = one_reply(exchange(port, request("POST", "/v1/chat/completions", body)))
    assert status == 200 and json.loads(reply)["choices"][0]["finish_reason"] == "stop"


def answer_to(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict, dict, float]:
    """(status, headers, OpenAI error, seconds until the server closed) of what `data` gets."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        status, headers, body = one_reply(read_to_end(sock))
    return status, dict(headers), error_of(body), time.monotonic() - started


@pytest.mark.parametrize(
    "size",
    [b"ffffffffffffffffffff", b"zz", b"-1", b"1" * 21, b"4;"],
    ids=["2**80", "not-hex", "negative", "21-digits", "bad-extension"],
)
def test_a_malformed_chunk_size_is_a_prompt_400_in_openai_shape(port, size):
    status, headers, error, took = answer_to(port, CHAT_HEAD + CHUNKED + size + b"\r\n" + b'{"messages"')
    assert status == 400 and error["code"] == "invalid_chunked_body" and "chunk" in error["message"]
    assert headers["connection"] == "close" and took < 1.0
    assert_serves(port)


def test_a_chunk_declaring_more_than_the_body_limit_is_a_prompt_413(port):
    status, headers, error, took = answer_to(port, CHAT_HEAD + CHUNKED + b"500000\r\n" + b'{"messages"')
    assert status == 413 and error["code"] == "body_too_large" and f"{4 << 20} bytes" in error["message"]
    assert took < 1.0
    assert_serves(port)


def test_a_malformed_head_is_a_400_in_openai_shape(port):
    status, _, error, took = answer_to(port, request("POST", "/v1/chat/completions", headers=(b"Content-Length: -1",)))
    assert status == 400 and error["code"] == "invalid_http" and f"{16 << 10} bytes" in error["message"]
    assert took < 1.0


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    _, _, page = one_reply(exchange(port, request("GET", "/metrics")))
    return {
        f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
    }


def test_a_stalled_body_gets_408_at_the_body_timeout_and_is_counted(port):
    errors = 'pdchat_router_errors_total{"code": "body_timeout", "status": "408"}'
    client_errors = 'pdchat_router_requests_total{"outcome": "client_error"}'
    before = scrape(port)
    head = CHAT_HEAD + b"X-Request-Id: stalled-1\r\nContent-Length: 100\r\n\r\n"
    status, headers, error, took = answer_to(port, head + b'{"messages": [')
    assert status == 408 and error["code"] == "body_timeout" and f"{BODY_TIMEOUT_S:g} s" in error["message"]
    assert headers["x-request-id"] == "stalled-1" and headers["connection"] == "close"
    assert BODY_TIMEOUT_S - 0.2 <= took <= BODY_TIMEOUT_S + 1.0
    after = scrape(port)
    assert after.get(errors, 0) == before.get(errors, 0) + 1
    assert after[client_errors] == before[client_errors] + 1
    assert after["pdchat_router_requests_in_flight"] == 0
    assert_serves(port)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_body_sent_at_once_is_read_by_the_client_as_a_413(port, framing):
    """The front answers at the head (or the chunk's size), with 8 MB still arriving: closing
    then would reset the connection, and the client would never read the answer."""
    body = b"x" * (8 << 20)
    if framing == "chunked":
        data = CHAT_HEAD + CHUNKED + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    else:
        data = CHAT_HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    status, headers, error, _ = answer_to(port, data)
    assert status == 413 and error["code"] == "body_too_large"
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert_serves(port)
