"""The one error vocabulary (pdchat.core.errors): each code's spelling on every wire, the
wire tag, and the code of each error class."""

from __future__ import annotations

import importlib.util
import sys
from http import HTTPStatus
from pathlib import Path

import grpc
import pytest

from pdchat.clients.chat import ChatError, _grpc_error
from pdchat.core.errors import (
    ErrorCode,
    InvalidRequest,
    ModelUnavailable,
    PdchatError,
    Unavailable,
    error_code,
    parse_tag,
    tag,
    tagged_message,
)
from pdchat.core.kv.base import KVBudgetExceeded, KVUnavailable
from pdchat.core.kv.shm import KVDirectoryRefused
from pdchat.ensemble.gate import ForwardedIdsRejected, Rejection
from pdchat.ensemble.seal import SealRefusal, Unsealed

# pb_utils.TritonError's codes, as the python backend documents them. The class lives in the
# backend stub's binary only (not importable here): test_triton_codes_are_the_stubs checks it.
TRITON_CODES = (
    "UNKNOWN",
    "INTERNAL",
    "NOT_FOUND",
    "INVALID_ARG",
    "UNAVAILABLE",
    "UNSUPPORTED",
    "ALREADY_EXISTS",
    "CANCELLED",
)


def test_each_code_names_a_triton_code_and_a_grpc_status():
    for code in ErrorCode:
        assert code.triton_code == code.name and code.triton_code in TRITON_CODES
        assert grpc.StatusCode[code.grpc_status].name == code.grpc_status


def test_triton_codes_are_the_stubs():
    spec = importlib.util.find_spec("pytriton")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stubs = Path(spec.submodule_search_locations[0]) / "tritonserver/python_backend_stubs"
    stub = stubs / version / "triton_python_backend_stub"
    if not stub.exists():
        pytest.skip(f"no python backend stub for Python {version}")
    binary = stub.read_bytes()
    assert b"\0TritonError\0" in binary
    assert [name for name in TRITON_CODES if b"\0" + name.encode() + b"\0" not in binary] == []


def test_the_mapping_table():
    table = {code: (code.grpc_status, code.http_status, code.openai_type) for code in ErrorCode}
    assert table == {
        ErrorCode.INVALID_ARG: ("INVALID_ARGUMENT", 400, "invalid_request_error"),
        ErrorCode.NOT_FOUND: ("NOT_FOUND", 404, "invalid_request_error"),
        ErrorCode.UNAVAILABLE: ("UNAVAILABLE", 503, "service_unavailable"),
        ErrorCode.INTERNAL: ("INTERNAL", 500, "server_error"),
    }
    assert all(HTTPStatus(code.http_status) for code in ErrorCode)


@pytest.mark.parametrize("code", [code for code in ErrorCode if code is not ErrorCode.NOT_FOUND])
def test_statuses_map_back_to_their_code(code):
    assert ErrorCode.from_grpc_status(code.grpc_status) is code
    assert ErrorCode.from_http_status(code.http_status) is code
    assert ErrorCode.from_openai_code(code.openai_code) is code


def test_not_found_is_a_model_not_served_known_by_its_tag_only():
    """An untagged gRPC NOT_FOUND is Triton's own (no such Triton model): a server fault."""
    code = ErrorCode.NOT_FOUND
    assert code.openai_code == "model_not_found" and code.is_client_error
    assert ErrorCode.from_openai_code("model_not_found") is code
    assert ErrorCode.from_http_status(404) is code
    assert ErrorCode.from_grpc_status("NOT_FOUND") is ErrorCode.INTERNAL
    assert _grpc_error(_TritonClientError("[NOT_FOUND] no model 'x'", "StatusCode.NOT_FOUND")).code is code


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (405, ErrorCode.INVALID_ARG),
        (413, ErrorCode.INVALID_ARG),
        (401, ErrorCode.INVALID_ARG),
        (502, ErrorCode.INTERNAL),
        (200, ErrorCode.INTERNAL),
    ],
)
def test_other_http_statuses(status, code):
    assert ErrorCode.from_http_status(status) is code


@pytest.mark.parametrize("status", ["NOT_FOUND", "ALREADY_EXISTS", "DEADLINE_EXCEEDED", "UNKNOWN", ""])
def test_grpc_statuses_pdchat_sends_none_of_are_internal(status):
    assert ErrorCode.from_grpc_status(status) is ErrorCode.INTERNAL


@pytest.mark.parametrize("code", list(ErrorCode))
def test_tag_round_trips(code):
    tagged = tag(code, "max_tokens must be positive")
    assert tagged == f"[{code.name}] max_tokens must be positive"
    assert parse_tag(tagged) == (code, "max_tokens must be positive")
    assert parse_tag(f"in ensemble 'chat_ensemble', {tagged}") == (code, "max_tokens must be positive")
    assert tag(ErrorCode.INTERNAL, tagged) == tagged, "a relayed message keeps its tag"


@pytest.mark.parametrize(
    "message",
    [
        "no tag",
        "[ALREADY_EXISTS] not a pdchat code",
        "an [INVALID_ARG] inside",
        "[INVALID_ARG]no space",
    ],
)
def test_untagged_messages_parse_as_they_are(message):
    assert parse_tag(message) == (None, message)


def test_tagged_message_names_the_type_of_internal_errors_only():
    assert tagged_message(InvalidRequest("bad")) == "[INVALID_ARG] bad"
    assert tagged_message(Unavailable("full")) == "[UNAVAILABLE] full"
    assert tagged_message(KVUnavailable("gone")) == "[INTERNAL] KVUnavailable: gone"
    assert tagged_message(KeyError("x")) == "[INTERNAL] KeyError: 'x'"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("m"), ErrorCode.INVALID_ARG),
        (ForwardedIdsRejected(Rejection.MALFORMED, "m"), ErrorCode.INVALID_ARG),
        (Unsealed("m", SealRefusal.EXPIRED, "d"), ErrorCode.INVALID_ARG),
        (Unavailable("m"), ErrorCode.UNAVAILABLE),
        (KVBudgetExceeded("m"), ErrorCode.UNAVAILABLE),
        (ModelUnavailable("m"), ErrorCode.INTERNAL),
        (KVUnavailable("m"), ErrorCode.INTERNAL),
        (KVDirectoryRefused("m"), ErrorCode.INTERNAL),
        (ChatError("m"), ErrorCode.INTERNAL),
        (ChatError("m", ErrorCode.UNAVAILABLE), ErrorCode.UNAVAILABLE),
    ],
)
def test_each_error_has_its_code(error, code):
    assert isinstance(error, PdchatError) and error_code(error) is code


def test_errors_not_raised_as_pdchat_errors_are_internal():
    assert error_code(ValueError("m")) is ErrorCode.INTERNAL


class _TritonClientError:
    """What tritonclient hands a stream callback: a message, and a status outside streams only."""

    def __init__(self, message: str, status: str | None = None):
        self._message, self._status = message, status

    def message(self) -> str:
        return self._message

    def status(self) -> str | None:
        return self._status


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (_TritonClientError("[UNAVAILABLE] decode is full"), ErrorCode.UNAVAILABLE, "decode is full"),
        (_TritonClientError("in ensemble 'chat_ensemble', [INVALID_ARG] bad"), ErrorCode.INVALID_ARG, "bad"),
        (_TritonClientError("[INVALID_ARG] bad", "StatusCode.INVALID_ARGUMENT"), ErrorCode.INVALID_ARG, "bad"),
        (_TritonClientError("failed to connect", "StatusCode.UNAVAILABLE"), ErrorCode.UNAVAILABLE, "failed to connect"),
        (_TritonClientError("unknown model", "StatusCode.NOT_FOUND"), ErrorCode.INTERNAL, "unknown model"),
        (_TritonClientError("untagged"), ErrorCode.INTERNAL, "untagged"),
    ],
)
def test_client_errors_take_the_code_of_the_status_or_the_tag(error, code, message):
    chat_error = _grpc_error(error)
    assert chat_error.code is code and str(chat_error) == message
