"""pdchat's one error vocabulary: `ErrorCode`, the errors that carry one, and the wire tag.

Every error pdchat raises is a `PdchatError`, whose `code` says what the client may do
about it: fix the request (INVALID_ARG; NOT_FOUND when it names a model not served
here), retry later or elsewhere (UNAVAILABLE), or nothing (INTERNAL). Each code names
what stands for it on every wire pdchat speaks: Triton's error code
(`pb_utils.TritonError.<name>`), gRPC's status, HTTP's status and OpenAI's error `type`.
Anything else raised (a bug) is INTERNAL.

The wire tag: gRPC streams (how clients and the router reach the decoupled `chat`) carry
a response's error as a bare message, without its status code. So every error message
pdchat sends starts with its code, `[INVALID_ARG] ...` (`tag`), and clients read it back
(`parse_tag`): a request the server refused stays a client error at every hop. Only this
module writes or reads the tag.
"""

from __future__ import annotations

import re
from enum import Enum


class ErrorCode(Enum):
    """What an error means to its client, and its spelling on each wire.

    NOTE: a member's name is its Triton code name, which is also what the wire tag spells.
    """

    #             Triton code    gRPC status         HTTP  OpenAI error type
    INVALID_ARG = ("INVALID_ARG", "INVALID_ARGUMENT", 400, "invalid_request_error")
    NOT_FOUND = ("NOT_FOUND", "NOT_FOUND", 404, "invalid_request_error")  # a model not served (ModelNotFound)
    UNAVAILABLE = ("UNAVAILABLE", "UNAVAILABLE", 503, "service_unavailable")
    INTERNAL = ("INTERNAL", "INTERNAL", 500, "server_error")

    def __init__(self, triton_code: str, grpc_status: str, http_status: int, openai_type: str):
        self.triton_code = triton_code  # the attribute of pb_utils.TritonError
        self.grpc_status = grpc_status  # grpc.StatusCode's name
        self.http_status = http_status
        self.openai_type = openai_type

    @property
    def openai_code(self) -> str:
        """OpenAI's error `code`: the gRPC status name, but OpenAI's `model_not_found` for NOT_FOUND."""
        return "model_not_found" if self is ErrorCode.NOT_FOUND else self.grpc_status

    @property
    def is_client_error(self) -> bool:
        """Whether the request itself is at fault (another server would refuse it too)."""
        return self in (ErrorCode.INVALID_ARG, ErrorCode.NOT_FOUND)

    @classmethod
    def from_grpc_status(cls, name: str) -> ErrorCode:
        """The code of a gRPC status name; INTERNAL for statuses pdchat sends none of.

        NOTE: NOT_FOUND is pdchat's only through its tag: an untagged NOT_FOUND status is
        Triton's own (no such Triton model), a server fault, INTERNAL."""
        return _BY_GRPC_STATUS.get(name, cls.INTERNAL)

    @classmethod
    def from_openai_code(cls, name: str) -> ErrorCode:
        """The code of an OpenAI error `code` as pdchat's fronts write it (`openai_code`)."""
        return _BY_OPENAI_CODE.get(name, cls.INTERNAL)

    @classmethod
    def from_http_status(cls, status: int) -> ErrorCode:
        """The code of an HTTP status: 503 is UNAVAILABLE, 404 NOT_FOUND, any other 4xx the
        client's (INVALID_ARG), the rest INTERNAL."""
        if status in (cls.UNAVAILABLE.http_status, cls.NOT_FOUND.http_status):
            return cls.UNAVAILABLE if status == cls.UNAVAILABLE.http_status else cls.NOT_FOUND
        return cls.INVALID_ARG if 400 <= status < 500 else cls.INTERNAL


_BY_GRPC_STATUS = {code.grpc_status: code for code in ErrorCode if code is not ErrorCode.NOT_FOUND}
_BY_OPENAI_CODE = {code.openai_code: code for code in ErrorCode}
_BY_TRITON_CODE = {code.triton_code: code for code in ErrorCode}
_CODES = "|".join(_BY_TRITON_CODE)
_TAG = re.compile(rf"^\[({_CODES})\] ")
# Triton puts its own words before a step's error inside an ensemble.
_ENSEMBLE_TAG = re.compile(rf"^in ensemble '[^']*', \[({_CODES})\] ")


class PdchatError(Exception):
    """An error pdchat raises on purpose; `code` is what it becomes on the wire."""

    code: ErrorCode = ErrorCode.INTERNAL


class InvalidRequest(PdchatError):
    """The client sent something we cannot serve.

    The message must say what is wrong and, where it helps, what is accepted.
    """

    code = ErrorCode.INVALID_ARG


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve (OpenAI: 404 `model_not_found`)."""

    code = ErrorCode.NOT_FOUND


class Unavailable(PdchatError):
    """A limit of this server is reached (KV budget, queue): retry later or elsewhere.
    The message names the limit."""

    code = ErrorCode.UNAVAILABLE


class ModelUnavailable(PdchatError):
    """The configured model cannot be found or loaded; fails the model's load."""


def error_code(exc: BaseException) -> ErrorCode:
    """The code `exc` goes to its client with: its own for a PdchatError, else INTERNAL."""
    return exc.code if isinstance(exc, PdchatError) else ErrorCode.INTERNAL


def tag(code: ErrorCode, message: str) -> str:
    """`message` as sent on the wire: `[CODE] message`. A message tagged already (relayed
    from another hop) keeps its tag."""
    return message if _TAG.match(message) else f"[{code.triton_code}] {message}"


def parse_tag(message: str) -> tuple[ErrorCode | None, str]:
    """(code, message without its tag) of a message `tag` made, also when Triton relays it
    from an ensemble step; (None, message) for an untagged one (Triton's own errors)."""
    match = _TAG.match(message) or _ENSEMBLE_TAG.match(message)
    return (_BY_TRITON_CODE[match[1]], message[match.end() :]) if match else (None, message)


def tagged_message(exc: BaseException) -> str:
    """The message to send for `exc`, tagged with its code. An INTERNAL one also names its
    type: the client cannot act on it, whoever reads the logs must find where it came from."""
    code = error_code(exc)
    return tag(code, str(exc) if code is not ErrorCode.INTERNAL else f"{type(exc).__name__}: {exc}")
