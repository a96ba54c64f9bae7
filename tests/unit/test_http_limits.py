"""The HTTP front's pure checks: JSON nesting depth and the X-Request-Id rule."""

from __future__ import annotations

import json
import time

import pytest

from pdchat.clients.chat import ChatError
from pdchat.clients.openai_api import ApiError, JsonTooDeep, chat_api_error, json_depth, parse_json_body, request_id_of
from pdchat.core.errors import ErrorCode


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
    types = ["invalid_request_error", "service_unavailable", "server_error"]
    assert [ApiError.of(code, "m").type for code in ErrorCode] == types
