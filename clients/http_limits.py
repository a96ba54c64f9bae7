"""The HTTP front's limits, and the only module that touches uvicorn's internals.

The front is where untrusted bytes arrive, so it bounds everything a client controls before
the router sees it (`HttpSettings`): the request head's size and the time to send it, the
body's size and time (its JSON nesting: clients/http_body.py), the X-Request-Id forwarded to
both servers' logs, the API key, idle keep-alive connections and the number of connections.

`DeadlineH11Protocol` is uvicorn's pure-Python h11 protocol with deadlines, refusals in the
front's error shape and closes that do not reset; `Guard`, the outermost ASGI layer, checks
each request's head and counts chat requests however they end; `uvicorn_server` puts the app
on uvicorn with both, and a first signal drains it (clients/http_drain.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from types import FrameType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdchat.clients.http_drain import Drain
from pdchat.clients.http_errors import ApiError, body_too_large, error_response, outcome_of
from pdchat.clients.http_metrics import FrontMetrics
from pdchat.core.settings import DRAIN_TIMEOUT_S

log = logging.getLogger("pdchat.router.http")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no API key
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_RULE = "[A-Za-z0-9._:-]{1,128}"
_REQUEST_ID = re.compile(REQUEST_ID_RULE.encode())


@dataclass(frozen=True)
class HttpSettings:
    """Limits of the HTTP front. The defaults fit chat requests (a few KB of JSON, nested
    under 10 levels) with a wide margin; each bound exists because a client could
    otherwise hold memory, a thread or a connection slot for as long as it likes."""

    api_key: str | None = None  # like vLLM's --api-key: 'Authorization: Bearer KEY' on all but OPEN_PATHS
    tenant_header: str | None = None  # the header naming each request's tenant (clients/tenancy.py)
    max_body_bytes: int = 4 * 1024 * 1024  # 413 above; checked against Content-Length, then while reading
    max_json_depth: int = 64  # 400 above; json.loads recurses per level, so it is checked before parsing
    max_header_bytes: int = 16 * 1024  # the request head (h11's buffer), and the headers once parsed; 400 above
    header_timeout_s: float = 10.0  # the whole head, from connecting or from the previous response
    body_timeout_s: float = 30.0  # the whole body, from the end of the head; 408 past it
    linger_s: float = 2.0  # after an answer that leaves the body unread, what still arrives is dropped this long
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 256  # uvicorn answers 503 over it; also the most worker threads (Routes._in_thread)
    shutdown_timeout_s: float = 5.0  # a drain's wait for the requests it ended, then uvicorn's for open connections
    drain_timeout_s: float = field(default_factory=DRAIN_TIMEOUT_S.get)  # running requests' time to finish


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


class Guard:
    """The outermost ASGI layer, so that every answer passes it: the request-id rule and
    the API key, X-Request-Id on every answer, and the accounting of chat requests (the
    `counted` paths: outcome, requests in flight, `drain.running`) however they end."""

    def __init__(
        self, app: ASGIApp, settings: HttpSettings, metrics: FrontMetrics, drain: Drain, counted: frozenset[str]
    ):
        self.app, self.settings, self.metrics, self.drain, self.counted = app, settings, metrics, drain, counted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] not in self.counted or scope["method"] != "POST":
            return await self._answer(scope, receive, send)
        state = scope.setdefault("state", {})
        statuses: list[int] = []

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        self.metrics.in_flight.inc()
        try:
            with self.drain.counting():
                await self._answer(scope, receive, send_counted)
        finally:
            self.metrics.in_flight.dec()
            outcome = state.get("outcome") or (outcome_of(statuses[0]) if statuses else "cancelled")
            self.metrics.requests.labels(outcome).inc()

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's answer, or the refusal's, with X-Request-Id."""
        state = scope.setdefault("state", {})

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", state["request_id"].encode())]
            await send(message)

        refusal = self._refusal(scope, state)
        if refusal is None:
            await self.app(scope, receive, send_with_id)
            return
        self.metrics.count_error(refusal)
        await error_response(refusal)(scope, receive, send_with_id)

    def _refusal(self, scope: Scope, state: dict[str, Any]) -> ApiError | None:
        """Why the request is refused before any route sees it, or None; sets its id."""
        headers = dict(reversed(scope["headers"]))  # the first of repeated headers wins
        limit = self.settings.max_header_bytes
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
        key = self.settings.api_key
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


def uvicorn_server(app: ASGIApp, drain: Drain, host: str, port: int, settings: HttpSettings) -> DrainingServer:
    """A uvicorn server for the front's `app` (h11 with deadlines, asyncio loop), its first
    signal draining `drain`; `.run()` blocks."""

    def protocol(**kwargs: Any) -> DeadlineH11Protocol:
        return DeadlineH11Protocol(settings=settings, **kwargs)

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
    return DrainingServer(config, drain)


class DrainingServer(uvicorn.Server):
    """uvicorn's server for the front: the first SIGTERM or SIGINT drains it (`Drain.drain`)
    before uvicorn's graceful stop; another signal stops at once, as in uvicorn."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        drain.stop = self._stop
        self._signalled = False
        self._draining: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:
            return super().handle_exit(sig, frame)
        self._signalled = True
        self.drain.draining = True  # not ready and not admitting from now; the drain starts on the next tick

    async def on_tick(self, counter: int) -> bool:
        if self._signalled and self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        await self.drain.drain()  # stops the server once drained

    def _stop(self) -> None:
        self.should_exit = True

    def serve_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain, stop gracefully and return (in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            # uvicorn re-raises the signal after its graceful stop, to the handler it found:
            # this one, so the process returns normally instead of dying of it.
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: setattr(self, "should_exit", True))
        self.run()
