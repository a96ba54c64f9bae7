"""The HTTP front's routes and error handlers, around one router (`ChatFront`).

`POST /v1/chat/completions` and `POST /v1/completions` (SSE when `stream`), `GET /v1/models`,
vLLM's `POST /tokenize`, `POST /detokenize` and `GET /version`, `GET /health`, `GET /metrics`
(Prometheus), `POST /drain`. Errors use OpenAI's shape (clients/http_errors.py).

A chat request runs on the front's event loop from the route to the gRPC streams
(`ChatFront.chat`, an async generator): no thread waits for its outputs. A client that
leaves gets the generator closed or cancelled, which cancels its requests on the servers.
What blocks (a large body's parsing, the health probes) runs in worker threads, one per
connection at most.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import Response

import pdchat
from pdchat import tensors
from pdchat.clients.chat import ChatError, ChatOutput, ChatStream
from pdchat.clients.choices import fan_out
from pdchat.clients.http_body import json_body
from pdchat.clients.http_drain import Drain, may_drain
from pdchat.clients.http_errors import ApiError, chat_api_error, error_response, json_response
from pdchat.clients.http_metrics import FrontMetrics
from pdchat.clients.http_sse import EventStream, answer_events
from pdchat.clients.tenancy import MissingTenant, kv_owner, salted, tenant_of
from pdchat.core.errors import ErrorCode

if TYPE_CHECKING:
    from pdchat.clients.fronts import ChatFront
    from pdchat.clients.http_limits import HttpSettings

log = logging.getLogger("pdchat.router.http")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# The generation routes, each with the `chat` input its body travels as (ChatFront.chat's form).
GENERATION_FORMS = {CHAT_PATH: tensors.REQUEST, COMPLETIONS_PATH: tensors.COMPLETION_REQUEST}
DISCONNECT_POLL_S = 0.5  # how often a whole answer being made looks whether its client is still there
T = TypeVar("T")


class Routes:
    """The routes and error handlers, around one router: `metrics` its counts, `drain`
    whether it admits chat requests."""

    def __init__(self, router: ChatFront, settings: HttpSettings, metrics: FrontMetrics, drain: Drain):
        self.router, self.settings, self.metrics, self.drain = router, settings, metrics, drain
        self._limiter: anyio.CapacityLimiter | None = None

    async def _in_thread(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` in a worker thread: one per connection at most, not anyio's default 40."""
        if self._limiter is None:  # made inside the event loop, which older anyio needs
            self._limiter = anyio.CapacityLimiter(self.settings.max_connections)
        return await anyio.to_thread.run_sync(func, *args, limiter=self._limiter)

    def _admitting(self) -> None:
        """Refuse a request that would render, tokenize or generate while the front drains."""
        if self.drain.draining:
            raise ApiError(503, "this front is draining: it takes no new requests", "draining", close=True)

    def error_response(self, error: ApiError, headers: dict[str, str] | None = None) -> Response:
        """`error`'s answer, counted."""
        self.metrics.count_error(error)
        return error_response(error, headers)

    async def generate(self, request: Request) -> Response:
        """A chat completion or a completion (GENERATION_FORMS: by the route), streamed or whole,
        its `n` choices each a request of one (pdchat.clients.choices)."""
        started = time.perf_counter()
        self._admitting()
        try:
            header = self.settings.tenant_header
            tenant = tenant_of(request.headers.getlist(header) if header else [], header)
        except MissingTenant as exc:
            raise ApiError(400, str(exc), "missing_tenant") from exc
        body = salted(await self._json_body(request), tenant)
        serve = functools.partial(self.router.chat, owner=kv_owner(tenant))
        outputs = fan_out(serve, body, request.state.request_id, GENERATION_FORMS[request.url.path])
        try:
            if body.get("stream"):
                return await self._streamed(outputs, request, started)
            return await self._whole(outputs, request)
        except ChatError as exc:
            raise chat_api_error(exc) from exc

    async def _streamed(self, outputs: ChatStream, request: Request, started: float) -> Response:
        """The answer's events, once its first output is here: an error before it is the
        response's, an error after it an event (clients/http_sse.py)."""
        try:
            first = await anext(outputs, None)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()  # cancels what runs (a no-op once it raised)
            raise
        if first is None:
            raise ApiError.of(ErrorCode.INTERNAL, "the decode server ended the stream without a response")
        self.metrics.ttft.observe(time.perf_counter() - started)
        events = answer_events(first, outputs, request.state, self.metrics)
        return EventStream(events, headers={"Cache-Control": "no-cache"})

    async def _whole(self, outputs: ChatStream, request: Request) -> Response:
        """The one answer. A client that leaves meanwhile (looked for every DISCONNECT_POLL_S)
        has its request cancelled on the servers, and is counted cancelled, not failed."""
        answering = asyncio.ensure_future(_all(outputs))
        try:
            while not (await asyncio.wait({answering}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    request.state.outcome = "cancelled"
                    log.info("request %s: client went away; decode work cancelled", request.state.request_id)
                    return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        finally:
            if not answering.done():  # its streams cancel their requests as it ends
                answering.cancel()
                await asyncio.wait({answering})
        answers = answering.result()
        if len(answers) != 1:
            raise ApiError.of(ErrorCode.INTERNAL, f"the decode server sent {len(answers)} responses for a whole answer")
        return Response(answers[0].response_json, 200, media_type="application/json")

    async def _json_body(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object within the limits (clients/http_body.py)."""
        return await json_body(request, self.settings.max_body_bytes, self.settings.max_json_depth, self._in_thread)

    async def models(self, request: Request) -> Response:
        try:
            names = await self.router.served_models()
        except ChatError as exc:
            raise chat_api_error(exc) from exc
        models = [{"id": name, "object": "model", "owned_by": "pdchat"} for name in names]
        return json_response(200, {"object": "list", "data": models})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `POST /tokenize` (ChatFront.tokenize)."""
        return await self._tokenizer_route(request, self.router.tokenize)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's `POST /detokenize` (ChatFront.detokenize)."""
        return await self._tokenizer_route(request, self.router.detokenize)

    async def _tokenizer_route(
        self, request: Request, answer: Callable[[dict[str, Any], str], Awaitable[dict[str, Any]]]
    ) -> Response:
        self._admitting()
        body = await self._json_body(request)
        try:
            return json_response(200, await answer(body, request.state.request_id))
        except ChatError as exc:
            raise chat_api_error(exc) from exc

    async def version(self, request: Request) -> Response:
        """vLLM's `GET /version`: pdchat's version."""
        return json_response(200, {"version": pdchat.__version__})

    async def health(self, request: Request) -> Response:
        if self.drain.draining:
            return json_response(503, {"ok": False, "draining": True, "running": self.drain.running})
        status = await self._in_thread(self.router.health)
        return json_response(200 if status["ok"] else 503, status)

    async def drain_route(self, request: Request) -> Response:
        """`POST /drain`: answered once drained, then the process stops (http_drain)."""
        if not may_drain(self.settings.api_key, request.client.host if request.client else None):
            raise ApiError(
                403, "POST /drain needs the front's API key (--api-key), or a client on this host", "forbidden"
            )
        await self.drain.drain()
        return json_response(200, {"drained": not self.drain.running})

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.page(), media_type=CONTENT_TYPE_LATEST)

    async def on_api_error(self, request: Request, exc: ApiError) -> Response:
        return self.error_response(exc)

    async def on_http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's 404 and 405, in OpenAI's shape."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return self.error_response(ApiError(exc.status_code, message, code), dict(exc.headers or {}))

    async def on_unexpected(self, request: Request, exc: Exception) -> Response:
        """A bug: a 500 in OpenAI's shape (Starlette still logs the traceback)."""
        return self.error_response(ApiError.of(ErrorCode.INTERNAL, "internal error in the router"))


async def _all(outputs: ChatStream) -> list[ChatOutput]:
    async with aclosing(outputs):
        return [output async for output in outputs]
