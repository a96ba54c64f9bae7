"""The router's OpenAI-compatible HTTP front: FastAPI on uvicorn's pure-Python h11 protocol.

Routes: `POST /v1/chat/completions` and `POST /v1/completions` (SSE when `stream`), `GET /v1/models`, vLLM's
`POST /tokenize`, `POST /detokenize` and `GET /version`, `GET /health`, `GET /metrics`
(Prometheus), `POST /drain`. The front is where untrusted bytes arrive, so it bounds
everything a client controls before the router sees it: the request head's size and the
time to send it, the body's size, time and JSON nesting, the X-Request-Id forwarded to
both servers' logs, idle keep-alive connections and the number of connections. Errors
use OpenAI's shape, `{"error": {"message", "type", "code"}}`.

`ChatFront.chat` is a blocking generator: each step runs in a worker thread, and a client
that leaves mid-stream gets the generator closed, which cancels the decode request.

Draining (`_Front.drain`: SIGTERM, SIGINT or `POST /drain`): new chat requests get 503
`draining` and `/health` 503 at once; the running ones have `drain_timeout_s` to finish,
then end with an error, their servers told to cancel them. SIGTERM then stops the process;
`/drain` leaves it up, not admitting, until a signal stops it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import h11
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

import pdchat
from pdchat import tensors
from pdchat.clients.chat import ChatError, ChatOutput, Waiting
from pdchat.clients.choices import fan_out
from pdchat.clients.grpc_streams import StreamLoop
from pdchat.clients.router import ClientLeft, Draining, RequestStreams, UpstreamTimeout
from pdchat.core.errors import ErrorCode
from pdchat.core.settings import DRAIN_TIMEOUT_S

if TYPE_CHECKING:
    from pdchat.clients.router import ChatFront

log = logging.getLogger("pdchat.router.http")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# The generation routes, each with the `chat` input its body travels as (ChatFront.chat's form).
GENERATION_FORMS = {CHAT_PATH: tensors.REQUEST, COMPLETIONS_PATH: tensors.COMPLETION_REQUEST}
OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no API key
OUTCOMES = ("ok", "client_error", "server_error", "cancelled")
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_RULE = "[A-Za-z0-9._:-]{1,128}"
_REQUEST_ID = re.compile(REQUEST_ID_RULE.encode())
DRAIN_POLL_S = 0.05  # how often a drain looks whether requests still run
DISCONNECT_POLL_S = 0.5  # how often a whole answer being made looks whether its client is still there
# A stream's next output is awaited on the loop this long at most, then by a worker thread
# (which sees the stream's stall deadline and its end).
ARRIVAL_WAIT_S = 0.25
T = TypeVar("T")


@dataclass(frozen=True)
class HttpSettings:
    """Limits of the HTTP front. The defaults fit chat requests (a few KB of JSON, nested
    under 10 levels) with a wide margin; each bound exists because a client could
    otherwise hold memory, a thread or a connection slot for as long as it likes."""

    api_key: str | None = None  # like vLLM's --api-key: 'Authorization: Bearer KEY' on all but OPEN_PATHS
    max_body_bytes: int = 4 * 1024 * 1024  # 413 above; checked against Content-Length, then while reading
    max_json_depth: int = 64  # 400 above; json.loads recurses per level, so it is checked before parsing
    max_header_bytes: int = 16 * 1024  # the request head (h11's buffer), and the headers once parsed; 400 above
    header_timeout_s: float = 10.0  # the whole head, from connecting or from the previous response
    body_timeout_s: float = 30.0  # the whole body, from the end of the head; 408 past it
    linger_s: float = 2.0  # after an answer that leaves the body unread, what still arrives is dropped this long
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 256  # uvicorn answers 503 over it; also the number of worker threads
    shutdown_timeout_s: float = 5.0  # a drain's wait for the requests it ended, then uvicorn's for open connections
    drain_timeout_s: float = field(default_factory=DRAIN_TIMEOUT_S.get)  # running requests' time to finish


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


class JsonTooDeep(ValueError):
    pass


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data`, found without recursion, in
    linear time: strings are cut out (an unterminated one runs to the end), then the
    highest running sum of +1 per opening and -1 per closing bracket (numpy: a 4 MiB
    body of brackets takes ~25 ms, a Python loop ten times that, holding the GIL)."""
    steps = _BRACKET_STEP[np.frombuffer(_JSON_STRING.sub(b"", data), np.uint8)]
    return int(steps.cumsum().max(initial=0))


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)  # '"?': never backtracks
_BRACKET_STEP = np.array([1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)], np.int32)


# Bodies up to this size are parsed on the event loop (~0.2 ms at the limit, ~0.04 ms for a
# 2 kB chat), larger ones in a worker thread (`_Front._json_body`).
INLINE_JSON_BYTES = 16 * 1024


def parse_json_body(data: bytes, max_depth: int) -> dict[str, Any]:
    """The request body as a JSON object; ValueError (JsonTooDeep for nesting) otherwise."""
    if json_depth(data) > max_depth:
        raise JsonTooDeep(f"the JSON body nests deeper than the allowed depth of {max_depth}")
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def request_id_of(raw: bytes | None) -> str:
    """The client's X-Request-Id, which goes to both servers and into logs, so only if it
    is short and plain; a generated one when the client sent none."""
    if raw is None:
        return f"pdchat-{uuid.uuid4().hex}"
    if not _REQUEST_ID.fullmatch(raw):
        raise ValueError(
            f"the {REQUEST_ID_HEADER} header must match {REQUEST_ID_RULE} (got {len(raw)} bytes that do not)"
        )
    return raw.decode("ascii")


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
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


class _Metrics:
    """The front's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self, router: ChatFront):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdchat_router_requests", "Chat completion requests, by how they ended", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.errors = Counter(
            "pdchat_router_errors",
            "Error answers (streamed ones too), by HTTP status and error code",
            ["status", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pdchat_router_requests_in_flight", "Chat completion requests being served", registry=self.registry
        )
        self.ttft = Histogram(
            "pdchat_router_ttft_seconds",
            "Streamed requests: from the request to its first chunk",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "pdchat_router_inter_token_seconds",
            "Streamed requests: between consecutive chunks",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.registry.register(_RouterStatsCollector(router))

    def page(self) -> bytes:
        return generate_latest(self.registry)


class _RouterStatsCollector:
    """Reads the router's own counters at scrape time, so the router needs no Prometheus."""

    def __init__(self, router: ChatFront):
        self.router = router

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "pdchat_router_prefill_fallbacks",
            "Requests decode served whole because prefill failed",
            value=self.router.stats.prefill_fallbacks,
        )


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends: a client
    that leaves while a chunk is being sent must cancel the decode request too."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class _Arrivals:
    """The outputs of one stream (a request of one choice), each taken on the event loop
    as it arrives: no worker thread waits for each, and outputs that arrived together are
    sent together. What may block (the stream's end, an error, a stall past
    ARRIVAL_WAIT_S) is still taken by a worker thread (`in_thread`).

    NOTE: `next(outputs)` runs on the loop only when `streams.waiting()` is OUTPUT: then
    the output is queued and the generators above it only pass it on."""

    def __init__(
        self,
        outputs: Iterator[ChatOutput],
        streams: RequestStreams,
        in_thread: Callable[..., Awaitable[ChatOutput | None]],
    ):
        self._outputs, self._streams, self._in_thread = outputs, streams, in_thread
        self._loop, self._thread_id = asyncio.get_running_loop(), threading.get_ident()
        self._arrived = asyncio.Event()
        streams.on_arrival = self._on_arrival

    async def next(self) -> ChatOutput | None:
        deadline = self._loop.time() + ARRIVAL_WAIT_S
        while True:
            self._arrived.clear()
            waiting = self._streams.waiting()
            if waiting is Waiting.OUTPUT:
                return next(self._outputs, None)
            remaining = deadline - self._loop.time()
            if waiting is Waiting.OTHER or remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return await self._in_thread(next, self._outputs, None)

    def _on_arrival(self) -> None:  # on the streams' loop: this one (StreamLoop.attach), or another's thread
        if threading.get_ident() == self._thread_id:
            self._arrived.set()
            return
        try:
            self._loop.call_soon_threadsafe(self._arrived.set)
        except RuntimeError:  # the loop closed: the front is gone, nobody waits
            pass


def _event(data: dict[str, Any] | str) -> bytes:
    """One SSE event; a server's response JSON goes out as the text it came in."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return b"data: " + text.encode() + b"\n\n"


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    """JSON as the router always wrote it: non-ASCII kept, NaN allowed (Starlette's refuses)."""
    return Response(json.dumps(body, ensure_ascii=False).encode(), status, headers, media_type="application/json")


class _Front:
    """The routes and error handlers, around one router."""

    def __init__(self, router: ChatFront, settings: HttpSettings):
        self.router, self.settings = router, settings
        self.metrics = _Metrics(router)
        self._limiter: anyio.CapacityLimiter | None = None
        self.running = 0  # chat requests being served (counted by _Guard)
        self.draining = False  # set once, never cleared
        self._drain: asyncio.Future[None] | None = None

    async def _in_thread(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` in a worker thread: one per connection at most, not anyio's default 40."""
        if self._limiter is None:  # made inside the event loop, which older anyio needs
            self._limiter = anyio.CapacityLimiter(self.settings.max_connections)
        return await anyio.to_thread.run_sync(func, *args, limiter=self._limiter)

    async def _close(self, outputs: Iterator[ChatOutput]) -> None:
        """Close the router's generator (cancelling its decode request), even when cancelled."""
        with anyio.CancelScope(shield=True):
            await self._in_thread(outputs.close)

    def error_response(self, error: ApiError, headers: dict[str, str] | None = None) -> Response:
        self.metrics.errors.labels(str(error.status), error.code).inc()
        return _json(
            error.status, error.body(), {**(headers or {}), **({"Connection": "close"} if error.close else {})}
        )

    async def generate(self, request: Request) -> Response:
        """A chat completion or a completion (GENERATION_FORMS: by the route), streamed or whole,
        its `n` choices each a request of one (pdchat.clients.choices)."""
        started = time.perf_counter()
        if self.draining:
            raise ApiError(503, "this front is draining: it takes no new requests", "draining", close=True)
        body = await self._json_body(request)
        StreamLoop.attach(asyncio.get_running_loop())  # this loop reads its requests' streams
        streams = RequestStreams()
        serve = functools.partial(self.router.chat, streams=streams)
        outputs = fan_out(serve, body, request.state.request_id, GENERATION_FORMS[request.url.path])
        try:
            if not body.get("stream"):
                return await self._whole(outputs, request, streams)
            first = await self._in_thread(next, outputs, None)
        except ChatError as exc:
            raise chat_api_error(exc) from exc  # the generator is done: it raised
        except BaseException:
            await self._close(outputs)
            raise
        if first is None:
            raise ApiError.of(ErrorCode.INTERNAL, "the decode server ended the stream without a response")
        self.metrics.ttft.observe(time.perf_counter() - started)
        taken = _Arrivals(outputs, streams, self._in_thread) if body.get("n") in (None, 1) else None
        next_output = taken.next if taken is not None else functools.partial(self._in_thread, next, outputs, None)
        events = self._events(outputs, first, next_output, request.state)
        return _EventStream(events, headers={"Cache-Control": "no-cache"})

    async def _whole(self, outputs: Iterator[ChatOutput], request: Request, streams: RequestStreams) -> Response:
        """The one answer. A client that leaves meanwhile (looked for every DISCONNECT_POLL_S)
        has its request cancelled on the servers, and is counted cancelled, not failed."""
        answering = asyncio.ensure_future(self._in_thread(list, outputs))
        while not (await asyncio.wait({answering}, timeout=DISCONNECT_POLL_S))[0]:
            if not streams.cancelled and await request.is_disconnected():
                request.state.outcome = "cancelled"
                log.info("request %s: client went away; decode work cancelled", request.state.request_id)
                await self._in_thread(streams.cancel)
        try:
            answers = answering.result()
        except ClientLeft:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        if len(answers) != 1:
            raise ApiError.of(ErrorCode.INTERNAL, f"the decode server sent {len(answers)} responses for a whole answer")
        return Response(answers[0].response_json, 200, media_type="application/json")

    async def _events(
        self,
        outputs: Iterator[ChatOutput],
        first: ChatOutput,
        next_output: Callable[[], Awaitable[ChatOutput | None]],
        state: State,
    ) -> AsyncIterator[bytes]:
        """Chunks, then `[DONE]`; an error after the first chunk is a chunk of its own.
        `next_output()`: the output after the last (None at the end)."""
        try:
            output: ChatOutput | None = first
            last = time.perf_counter()
            try:
                while output is not None:
                    yield _event(output.response_json)
                    output = await next_output()
                    now = time.perf_counter()
                    if output is not None:
                        self.metrics.inter_token.observe(now - last)
                    last = now
                state.outcome = "ok"
            except ChatError as exc:
                error = chat_api_error(exc)
                state.outcome = outcome_of(error.status)
                self.metrics.errors.labels(str(error.status), error.code).inc()
                yield _event(error.body())
            yield b"data: [DONE]\n\n"
        except Exception:
            state.outcome = "server_error"  # a bug, not a client leaving
            raise
        finally:
            if getattr(state, "outcome", None) is None:
                state.outcome = "cancelled"
                log.info("request %s: client went away; decode work cancelled", state.request_id)
            await self._close(outputs)

    async def _json_body(self, request: Request) -> dict[str, Any]:
        """The body parsed: on the event loop up to INLINE_JSON_BYTES (a chat's first token
        skips two thread hops), in a worker thread beyond, so a large body does not hold up
        the streams this loop serves."""
        data = await self._read_body(request)
        try:
            if len(data) <= INLINE_JSON_BYTES:
                return parse_json_body(data, self.settings.max_json_depth)
            return await self._in_thread(parse_json_body, data, self.settings.max_json_depth)
        except JsonTooDeep as exc:
            raise ApiError(400, str(exc), "json_too_deep") from exc
        except ValueError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}", "invalid_json") from exc

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused as soon as it is known to exceed the limit: by its declared
        length before reading, else by what has arrived (chunked bodies declare none)."""
        limit = self.settings.max_body_bytes
        too_large = body_too_large(limit)
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > limit:  # h11 let only digits through
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect as exc:
            refusal = getattr(request.state, "refusal", None)
            if refusal is not None:  # the protocol answered it (DeadlineH11Protocol._refuse): counted here
                raise refusal from exc
            request.state.outcome = "cancelled"
            raise ApiError(
                400, "the client left before sending the whole body", "client_disconnected", close=True
            ) from exc
        return b"".join(chunks)

    async def models(self, request: Request) -> Response:
        try:
            names = await self._in_thread(self.router.served_models)
        except ChatError as exc:
            raise chat_api_error(exc) from exc
        models = [{"id": name, "object": "model", "owned_by": "pdchat"} for name in names]
        return _json(200, {"object": "list", "data": models})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `POST /tokenize` (ChatFront.tokenize)."""
        return await self._tokenizer_route(request, self.router.tokenize)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's `POST /detokenize` (ChatFront.detokenize)."""
        return await self._tokenizer_route(request, self.router.detokenize)

    async def _tokenizer_route(self, request: Request, answer: Callable[..., dict[str, Any]]) -> Response:
        body = await self._json_body(request)
        try:
            return _json(200, await self._in_thread(answer, body, request.state.request_id))
        except ChatError as exc:
            raise chat_api_error(exc) from exc

    async def version(self, request: Request) -> Response:
        """vLLM's `GET /version`: pdchat's version."""
        return _json(200, {"version": pdchat.__version__})

    async def health(self, request: Request) -> Response:
        if self.draining:
            return _json(503, {"ok": False, "draining": True, "running": self.running})
        status = await self._in_thread(self.router.health)
        return _json(200 if status["ok"] else 503, status)

    async def drain_route(self, request: Request) -> Response:
        """`POST /drain`: answered once drained; the process stays up, not admitting."""
        await self.drain()
        return _json(200, {"drained": not self.running})

    async def drain(self) -> None:
        """Stop admitting chat requests (503 `draining`) and answer `/health` with 503 from
        now on; let the running ones finish within `drain_timeout_s`, then end the rest
        (`ChatFront.abort`: their clients get an error, their servers cancel them).
        Returns once none runs, or `shutdown_timeout_s` after ending them. A later call
        waits for the same drain."""
        self.draining = True
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained())
        await asyncio.shield(self._drain)

    async def _drained(self) -> None:
        timeout = self.settings.drain_timeout_s
        log.info("draining: no new requests; %d running have %g s to finish", self.running, timeout)
        if not await self._settled(timeout):
            log.warning("draining: ending the %d requests still running after %g s", self.running, timeout)
            reason = (
                f"this front is draining and the request did not finish within its drain timeout of {timeout:g} s "
                "(setting drain_timeout_s)"
            )
            await anyio.to_thread.run_sync(self.router.abort, reason)  # not _in_thread: its threads may be stuck
            await self._settled(self.settings.shutdown_timeout_s)
        log.info("drained: %d requests still running", self.running)

    async def _settled(self, timeout: float) -> bool:
        """Whether no chat request runs, waiting up to `timeout` for that."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return not self.running

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


class _Guard:
    """The outermost layer, so that every answer passes it: the request-id rule and the
    API key, X-Request-Id on every answer, and the accounting of chat requests (outcome,
    requests in flight) however they end."""

    def __init__(self, app: ASGIApp, front: _Front):
        self.app, self.front = app, front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"] in GENERATION_FORMS and scope["method"] == "POST"
        metrics = self.front.metrics
        state = scope.setdefault("state", {})
        statuses: list[int] = []

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", state["request_id"].encode())]
            await send(message)

        if counted:
            metrics.in_flight.inc()
            self.front.running += 1
        try:
            refusal = self._refusal(scope, state)
            if refusal is not None:
                await self.front.error_response(refusal)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            if counted:
                metrics.in_flight.dec()
                self.front.running -= 1
                metrics.requests.labels(
                    state.get("outcome") or (outcome_of(statuses[0]) if statuses else "cancelled")
                ).inc()

    def _refusal(self, scope: Scope, state: dict[str, Any]) -> ApiError | None:
        """Why the request is refused before any route sees it, or None; sets its id."""
        headers = dict(reversed(scope["headers"]))  # the first of repeated headers wins
        limit = self.front.settings.max_header_bytes
        if sum(len(name) + len(value) for name, value in scope["headers"]) > limit:
            # h11 bounds a head that arrives in pieces; one that arrives whole is checked here.
            state["request_id"] = request_id_of(None)
            return ApiError(400, f"the request headers exceed {limit} bytes", "headers_too_large", close=True)
        try:
            state["request_id"] = request_id_of(headers.get(b"x-request-id"))
        except ValueError as exc:
            state["request_id"] = request_id_of(None)
            log.warning("request %s: refused: %s", state["request_id"], exc)
            return ApiError(400, str(exc), "invalid_request_id", close=True)
        if b"transfer-encoding" in headers and b"content-length" in headers:
            # h11 reads the body as chunked; a proxy in front might not have (RFC 9112 6.1).
            return ApiError(
                400,
                "a request must not carry both Transfer-Encoding and Content-Length",
                "ambiguous_framing",
                close=True,
            )
        key = self.front.settings.api_key
        if key and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + key.encode()):
                return ApiError(
                    401,
                    "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                    "invalid_api_key",
                    close=True,
                )
        return None


def create_app(router: ChatFront, settings: HttpSettings | None = None) -> _Guard:
    """The ASGI app of the front (for uvicorn or any ASGI server; `serve` adds the timeouts)."""
    front = _Front(router, settings or HttpSettings())
    app = FastAPI(title="pdchat router", docs_url=None, redoc_url=None, openapi_url=None)
    for path in GENERATION_FORMS:
        app.add_api_route(path, front.generate, methods=["POST"])
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    app.add_api_route("/tokenize", front.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", front.detokenize, methods=["POST"])
    app.add_api_route("/version", front.version, methods=["GET"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.metrics_page, methods=["GET"])
    app.add_api_route("/drain", front.drain_route, methods=["POST"])
    app.add_exception_handler(ApiError, front.on_api_error)
    app.add_exception_handler(HTTPException, front.on_http_exception)
    app.add_exception_handler(Exception, front.on_unexpected)
    return _Guard(app, front)


class _LingeringTransport:
    """A connection's transport whose close lingers while `unread()`: the answer is sent,
    then the write side shut (FIN), and what the client still sends is dropped until it
    closes its side or `linger_s` pass. A socket closed with unread bytes in its receive
    buffer sends a reset, which can destroy the answer before the client reads it."""

    def __init__(
        self, transport: asyncio.Transport, unread: Callable[[], bool], loop: asyncio.AbstractEventLoop, linger_s: float
    ):
        self._transport, self._unread, self._loop, self._linger_s = transport, unread, loop, linger_s
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering:
            return
        if not self._unread() or not self._transport.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()  # once what is buffered has gone out
        self._transport.resume_reading()
        self._loop.call_later(self._linger_s, self._transport.close)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines for receiving a request, answers for a body
    that cannot be read, and closes that do not reset the connection. uvicorn times out
    only idle kept-alive connections: a client dribbling its head or body (slowloris)
    would hold its connection, and a place under the connection cap, forever.

    One timer per connection, for the part being received: the head (h11 state IDLE),
    armed on connecting and after each response, or the body (SEND_BODY), armed when
    the head is complete. Bytes arriving do not extend it; the next part replaces it.
    Past the head's deadline the connection closes; past the body's it gets a 408.

    What h11 refuses (a malformed head or chunked body) gets a 400, and a chunk declaring
    more than `max_body_bytes` a 413 as soon as its size is read, in the front's error shape
    (`_refuse`). A close that leaves the request unread lingers (`_LingeringTransport`)."""

    def __init__(self, *args: Any, settings: HttpSettings, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._timeouts = {h11.IDLE: settings.header_timeout_s, h11.SEND_BODY: settings.body_timeout_s}
        self._limits = settings
        self._receiving: object = None  # h11's state (a class) whose deadline is armed
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._closer = _LingeringTransport(transport, self._unread, self.loop, self._limits.linger_s)
        super().connection_made(self._closer)  # type: ignore[arg-type]
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._closer.lingering:
            return  # answered and closing: dropped
        super().data_received(data)
        self._check_chunk()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request's bytes (uvicorn answers in plain text): before the head
        was whole, the head; after it, the chunked body (a Content-Length body cannot be malformed)."""
        if self.conn.our_state is h11.IDLE:
            limit = self._limits.max_header_bytes
            self._refuse(
                ApiError(400, f"the request head is malformed or over {limit} bytes", "invalid_http", close=True)
            )
        else:
            self._refuse(
                _malformed_chunks("each chunk is a size in hex digits and CRLF, then that many bytes and CRLF")
            )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        state = self.conn.their_state
        receiving = state if state in self._timeouts and not self.transport.is_closing() else None
        if receiving is self._receiving:
            return
        self._disarm()
        self._receiving = receiving
        if receiving is not None:
            self._deadline = self.loop.call_later(self._timeouts[receiving], self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        timeout = self._timeouts[self._receiving]
        if self._receiving is h11.IDLE:
            log.info("%s: closed; the request head did not arrive within %.0f s", _peer(self.client), timeout)
            self.transport.close()
        else:
            log.info("%s: 408; the request body did not arrive within %.0f s", _peer(self.client), timeout)
            self._refuse(
                ApiError(408, f"the request body did not arrive within {timeout:g} s", "body_timeout", close=True)
            )

    def _check_chunk(self) -> None:
        """Refuse the chunk being read, once its size line is, if it declares more than the
        body may hold (413) or more than a 63-bit length (400): its bytes need not be awaited.

        NOTE: h11 keeps the size of the chunk being read private (ChunkedReader._bytes_in_chunk);
        an h11 without it leaves the bytes that arrive to the app's count."""
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        pending = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
        if pending >= 1 << 63:
            self._refuse(_malformed_chunks("a chunk declares a size past 2**63 - 1 bytes"))
        elif pending > self._limits.max_body_bytes:
            self._refuse(body_too_large(self._limits.max_body_bytes))

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` in the app's place unless an answer has begun, and close: the request
        cannot be read to its end.

        NOTE: an app still reading the body then sees the client leave, and finds `error` as
        the request's `refusal` (scope state), to count as its own answer; what it sends is dropped."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(self._answer(error))
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.scope["state"]["refusal"] = error
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _answer(self, error: ApiError) -> bytes:
        """`error` as a whole HTTP response that closes the connection, with the request's
        X-Request-Id once the app has given it one."""
        body = json.dumps(error.body(), ensure_ascii=False).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        request_id = self.scope["state"].get("request_id") if self.conn.our_state is h11.SEND_RESPONSE else None
        if request_id is not None:
            headers.append((b"x-request-id", request_id.encode()))
        response = h11.Response(status_code=error.status, headers=headers, reason=HTTPStatus(error.status).phrase)
        return b"".join(self.conn.send(event) for event in (response, h11.Data(data=body), h11.EndOfMessage()))

    def _unread(self) -> bool:
        """Whether the client may still be sending a request that has been answered."""
        answered = self.conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        return answered and self.conn.their_state in (h11.SEND_BODY, h11.ERROR)


def _malformed_chunks(reason: str) -> ApiError:
    return ApiError(400, f"the chunked request body is malformed: {reason}", "invalid_chunked_body", close=True)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"


def make_server(
    router: ChatFront, host: str = "127.0.0.1", port: int = 8080, settings: HttpSettings | None = None
) -> uvicorn.Server:
    """A uvicorn server for the front (h11 with deadlines, asyncio loop); `.run()` blocks."""
    settings = settings or HttpSettings()

    def protocol(**kwargs: Any) -> DeadlineH11Protocol:
        return DeadlineH11Protocol(settings=settings, **kwargs)

    app = create_app(router, settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="asyncio",
        http=protocol,
        ws="none",
        lifespan="off",
        log_config=None,
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    return DrainingServer(config, app.front)


class DrainingServer(uvicorn.Server):
    """uvicorn's server for the front: the first SIGTERM or SIGINT drains it (`_Front.drain`)
    before uvicorn's graceful stop; another signal stops at once, as in uvicorn."""

    def __init__(self, config: uvicorn.Config, front: _Front):
        super().__init__(config)
        self.front = front
        self._signalled = False
        self._draining: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:
            return super().handle_exit(sig, frame)
        self._signalled = True
        self.front.draining = True  # not ready and not admitting from now; the drain starts on the next tick

    async def on_tick(self, counter: int) -> bool:
        if self._signalled and self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        await self.front.drain()
        self.should_exit = True


def serve(router: ChatFront, host: str = "127.0.0.1", port: int = 8080, settings: HttpSettings | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain, stop gracefully and return (in the main thread)."""
    server = make_server(router, host, port, settings)
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal after its graceful stop, to the handler it found:
        # this one, so the process returns normally instead of dying of it.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: setattr(server, "should_exit", True))
    server.run()
