"""P/D router: prefill on one server, decode on another, one OpenAI-compatible front.

`PDRouter` (library) drives the two legs over tritonclient gRPC: the prefill server's
`chat` renders, prefills and answers signed kv_transfer_params; the decode server's
`chat` gets the same request plus those params and the ids as a binary tensor, so it
neither renders nor tokenizes. Fallbacks lose no request: prefill unreachable or
failing -> decode serves the request whole; decode unreachable -> a clear error.

`serve()` puts it behind `POST /v1/chat/completions` (SSE when streaming),
`GET /v1/models` and `GET /health`, for the `openai` client or curl.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdchat.clients.chat import ChatError, ChatOutput, GrpcChat, chat_inputs
from pdchat.core.errors import InvalidRequest
from pdchat.core.protocol import parse_chat_json

log = logging.getLogger("pdchat.router")
PROBE_TIMEOUT_S = 2.0


@dataclass
class Backend:
    """One tritonserver (gRPC address): its idle clients, requests in flight, and whether
    it answered its last health probe."""

    url: str
    in_flight: int = 0
    idle: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    healthy: bool = True
    checked_at: float = 0.0

    @contextmanager
    def client(self) -> Iterator[GrpcChat]:
        try:
            chat = self.idle.get_nowait()
        except queue.Empty:
            chat = GrpcChat(self.url)
        try:
            yield chat
        except BaseException:
            chat.close()  # a client that saw a broken stream is not reused
            raise
        self.idle.put(chat)

    def probe(self) -> bool:
        self.healthy, self.checked_at = _ready(self.url), time.monotonic()
        return self.healthy


class BackendPool:
    """Least-loaded choice (fewest requests in flight) among the servers that answered
    their last probe, round-robin among equals. A server that failed a request is probed
    again before it gets another, at most once per `reprobe_s`."""

    def __init__(self, urls: list[str], role: str = "", reprobe_s: float = 1.0):
        if not urls:
            raise ValueError("a pool needs at least one server")
        self.backends = [Backend(u) for u in urls]
        self.role = role
        self.reprobe_s = reprobe_s
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def any_healthy(self) -> bool:
        """Whether some server is worth a request now (probing those due for it)."""
        now = time.monotonic()
        for backend in self.backends:
            if not backend.healthy and now - backend.checked_at >= self.reprobe_s:
                backend.probe()
        return any(b.healthy for b in self.backends)

    def mark_failed(self, backend: Backend) -> None:
        """A transport failure or server fault: probe it now, before it gets more requests."""
        backend.probe()

    @contextmanager
    def pick(self) -> Iterator[Backend]:
        if not self.any_healthy():
            raise ChatError(f"no {self.role or 'backend'} server is ready ({', '.join(b.url for b in self.backends)})",
                            "UNAVAILABLE")
        with self._lock:
            start = next(self._turn)
            order = self.backends[start % len(self.backends):] + self.backends[: start % len(self.backends)]
            backend = min([b for b in order if b.healthy] or order, key=lambda b: b.in_flight)
            backend.in_flight += 1
        try:
            yield backend
        finally:
            with self._lock:
                backend.in_flight -= 1


@dataclass
class RouterStats:
    requests: int = 0
    disaggregated: int = 0
    prefill_fallbacks: int = 0
    failed: int = 0


class PDRouter:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str]):
        self.prefill = BackendPool(prefill_urls, "prefill")
        self.decode = BackendPool(decode_urls, "decode")
        self.stats = RouterStats()
        self._served_model: str | None = None

    def chat(self, body: dict[str, Any], request_id: str = "") -> Iterator[ChatOutput]:
        """The decode server's responses for one chat request (streamed if body asks)."""
        request_id = request_id or f"pdchat-{uuid.uuid4().hex}"
        self.stats.requests += 1
        try:
            # Refuse what no server would take here: a bad request is not a prefill failure.
            parse_chat_json(json.dumps(body))
        except InvalidRequest as exc:
            raise ChatError(str(exc), "INVALID_ARGUMENT") from exc
        if not self.decode.any_healthy():
            # Prefill work for a request no decode server can finish would only pile up KV.
            self.stats.failed += 1
            raise ChatError(f"no decode server is ready ({', '.join(b.url for b in self.decode.backends)})", "UNAVAILABLE")
        handoff = self._prefill_leg(body, request_id)
        forwarded = {}
        if handoff is not None:
            forwarded = {"prompt_token_ids": handoff.prompt_token_ids, "kv_transfer_params": handoff.kv_transfer_params}
            self.stats.disaggregated += 1
        with self.decode.pick() as backend, backend.client() as client:
            try:
                yield from client.stream(chat_inputs(body, **forwarded), request_id=request_id)
            except ChatError as exc:
                self.stats.failed += 1
                if not exc.is_client_error:
                    self.decode.mark_failed(backend)
                    if not backend.healthy:
                        raise ChatError(f"decode server {backend.url} is unavailable: {exc}", "UNAVAILABLE") from exc
                raise

    def _prefill_leg(self, body: dict[str, Any], request_id: str) -> ChatOutput | None:
        """Signed handoff from a prefill server, or None to let decode do it all."""
        started = time.perf_counter()
        used = None
        try:
            with self.prefill.pick() as used, used.client() as client:
                inputs = chat_inputs({**body, "stream": False}, kv_transfer_params={"do_remote_decode": True})
                [output] = list(client.stream(inputs, request_id=request_id))
            log.info("request %s: prefill on %s in %.1f ms", request_id, used.url, 1000 * (time.perf_counter() - started))
            return output
        except ChatError as exc:
            if exc.is_client_error:
                raise  # the request itself is bad: decode would refuse it too
            if used is not None:
                self.prefill.mark_failed(used)
            self.stats.prefill_fallbacks += 1
            log.warning("request %s: prefill failed (%s: %s); decode serves it whole", request_id, exc.status, exc)
            return None

    def served_model(self) -> str:
        """The model name clients should send (asked of a decode server once)."""
        if self._served_model is None:
            probe = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            with self.decode.pick() as backend, backend.client() as client:
                self._served_model = next(iter(client.stream(chat_inputs(probe)))).response["model"]
        return self._served_model

    def health(self) -> dict[str, Any]:
        status = {
            "prefill": {b.url: b.probe() for b in self.prefill.backends},
            "decode": {b.url: b.probe() for b in self.decode.backends},
            "stats": self.stats.__dict__,
        }
        status["ok"] = any(status["decode"].values())
        return status


def _ready(url: str) -> bool:
    """Whether the server at `url` answers and its `chat` model is ready."""
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(url)
        try:
            return bool(client.is_model_ready("chat", client_timeout=PROBE_TIMEOUT_S))
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - unreachable counts as not ready
        return False


_HTTP_STATUS = {"INVALID_ARGUMENT": 400, "400": 400, "UNAVAILABLE": 503}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    router: PDRouter

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") == "/v1/models":
            try:
                model = self.router.served_model()
            except ChatError as exc:
                return self._error(exc)
            return self._json(200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "pdchat"}]})
        if self.path.rstrip("/") == "/health":
            status = self.router.health()
            return self._json(200 if status["ok"] else 503, status)
        self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return self._json(400, {"error": {"message": f"invalid JSON body: {exc}", "type": "invalid_request_error"}})
        request_id = self.headers.get("X-Request-Id") or f"pdchat-{uuid.uuid4().hex}"
        outputs = self.router.chat(body, request_id)
        try:
            if body.get("stream"):
                self._stream(outputs, request_id)
            else:
                [output] = list(outputs)
                self._json(200, output.response, request_id)
        except ChatError as exc:
            self._error(exc)
        except (BrokenPipeError, ConnectionResetError):
            log.info("request %s: client went away; decode work cancelled", request_id)
        finally:
            outputs.close()  # leaving early cancels the decode stream

    def _stream(self, outputs: Iterator[ChatOutput], request_id: str) -> None:
        first = next(outputs)  # errors before the first chunk still get an HTTP status
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Request-Id", request_id)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for output in itertools.chain([first], outputs):
                self._chunk(f"data: {json.dumps(output.response, ensure_ascii=False)}\n\n")
        except ChatError as exc:
            self._chunk(f"data: {json.dumps({'error': {'message': str(exc), 'type': exc.status}})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self._chunk("")

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _error(self, exc: ChatError) -> None:
        self._json(_HTTP_STATUS.get(exc.status, 500), {"error": {"message": str(exc), "type": exc.status or "server_error"}})

    def _json(self, status: int, body: dict, request_id: str = "") -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if request_id:
            self.send_header("X-Request-Id", request_id)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.info("%s %s", self.address_string(), format % args)


class _RouterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops connections when a burst of clients
    # connects at once (seen as resets after a 1 s SYN retry at 16 concurrent streams).
    request_queue_size = 1024


def make_server(router: PDRouter, host: str = "127.0.0.1", port: int = 8080) -> ThreadingHTTPServer:
    handler = type("RouterHandler", (_Handler,), {"router": router})
    return _RouterHTTPServer((host, port), handler)


def stream_completion(router_url: str, body: dict[str, Any], timeout: float = 600.0) -> Iterator[dict[str, Any]]:
    """Client side of the router API: the chunks of a streamed chat completion (SSE)."""
    import urllib.request

    request = urllib.request.Request(f"{router_url}/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        for line in reply:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ChatError(chunk["error"]["message"], chunk["error"].get("type", ""))
                yield chunk
