"""The HTTP front's answers in OpenAI's error shape, `{"error": {"message", "type", "code"}}`.

`ApiError` is every refusal or failure the front answers, whoever found it: the front's own
checks (head, body, route, API key), or a router's `ChatError` (`chat_api_error`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from pdchat.clients.backend_pool import Draining, UpstreamTimeout
from pdchat.clients.chat import ChatError
from pdchat.core.errors import ErrorCode


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP `status`, and OpenAI's `code`, which names
    what went wrong. `close`: the request body may be unread, so the connection cannot
    carry another request.

    NOTE: the front's own refusals (bad body, head, route or API key) are HTTP answers
    only; what the servers could send too is an `ErrorCode` (`of`)."""

    def __init__(self, status: int, message: str, code: str, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.close = status, message, code, close

    @classmethod
    def of(cls, code: ErrorCode, message: str) -> ApiError:
        """An error of `code`: its HTTP status and OpenAI `code` (ErrorCode.openai_code)."""
        return cls(code.http_status, message, code.openai_code)

    @property
    def type(self) -> str:
        """OpenAI's error type: that of the status's ErrorCode, but for the front's 401 and 504."""
        front_type = {401: "authentication_error", 504: "upstream_timeout"}.get(self.status)
        return front_type or ErrorCode.from_http_status(self.status).openai_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", "body_too_large", close=True)


def chat_api_error(exc: ChatError) -> ApiError:
    """A router error as an HTTP answer of its code; a stall and a drain are the front's
    own answers: 504 `upstream_timeout`, 503 `draining`."""
    if isinstance(exc, UpstreamTimeout):
        return ApiError(504, str(exc), "upstream_timeout")
    if isinstance(exc, Draining):
        return ApiError(503, str(exc), "draining")
    return ApiError.of(exc.code, str(exc))


def outcome_of(status: int) -> str:
    """How a chat request whose answer has `status` ended (a `pdchat_router_requests` label)."""
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


def json_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    """JSON as the router always wrote it: non-ASCII kept, NaN allowed (Starlette's refuses)."""
    return Response(json.dumps(body, ensure_ascii=False).encode(), status, headers, media_type="application/json")


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    """`error`'s answer; one that leaves the body unread closes the connection."""
    return json_response(
        error.status, error.body(), {**(headers or {}), **({"Connection": "close"} if error.close else {})}
    )
