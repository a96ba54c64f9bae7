"""P/D router: prefill on one server, decode on another, one OpenAI-compatible front.

`PDRouter` (library) drives the two legs over tritonclient gRPC: the prefill server's
`chat` renders, prefills and answers signed kv_transfer_params; the decode server's
`chat` gets the same request plus those params and the ids as a binary tensor, so it
neither renders nor tokenizes. Fallbacks lose no request: prefill unreachable or
failing -> decode serves the request whole; decode unreachable -> a clear error.

`pdchat.clients.openai_api` puts it behind `POST /v1/chat/completions` (SSE when
streaming), `GET /v1/models`, `GET /health` and `GET /metrics`, for the `openai` client or curl.
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
from typing import Any

from pdchat.clients.chat import ChatError, ChatOutput, GrpcChat, chat_inputs
from pdchat.core.errors import ErrorCode, InvalidRequest
from pdchat.core.request.protocol import ChatRequest, chat_request_from_body, utf8_json

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

    def none_ready(self) -> ChatError:
        """What a request gets while no server of the pool is ready."""
        return ChatError(
            f"no {self.role or 'backend'} server is ready ({', '.join(b.url for b in self.backends)})",
            ErrorCode.UNAVAILABLE,
        )

    @contextmanager
    def pick(self) -> Iterator[Backend]:
        if not self.any_healthy():
            raise self.none_ready()
        with self._lock:
            start = next(self._turn)
            order = self.backends[start % len(self.backends) :] + self.backends[: start % len(self.backends)]
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


class ChatFront:
    """What the OpenAI HTTP front (clients/openai_api.py) serves: chat requests streamed from
    the `chat` model of a pool of servers, the served model's name, health and stats."""

    def __init__(self, serving: BackendPool):
        self.serving = serving
        self.stats = RouterStats()
        self._served_model: str | None = None

    def chat(self, body: dict[str, Any], request_id: str = "") -> Iterator[ChatOutput]:
        raise NotImplementedError

    def served_model(self) -> str:
        """The model name clients should send (asked of a server once)."""
        if self._served_model is None:
            probe = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            with self.serving.pick() as backend, backend.client() as client:
                self._served_model = next(iter(client.stream(chat_inputs(probe)))).response["model"]
        return self._served_model

    def health(self) -> dict[str, Any]:
        status = {self.serving.role: {b.url: b.probe() for b in self.serving.backends}, "stats": self.stats.__dict__}
        status["ok"] = any(status[self.serving.role].values())
        return status

    def _validated(self, body: dict[str, Any]) -> tuple[bytes, ChatRequest]:
        """The body as the bytes every server gets, once it is known valid here (a bad
        request is the client's error, never a server failure)."""
        try:
            return utf8_json(body), chat_request_from_body(body, check_grammar=False)
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc

    def _stream(self, text: bytes, request_id: str, **forwarded: Any) -> Iterator[ChatOutput]:
        """Responses of one serving server; a server fault marks it for a probe."""
        if not self.serving.any_healthy():
            self.stats.failed += 1
            raise self.serving.none_ready()
        with self.serving.pick() as backend, backend.client() as client:
            try:
                yield from client.stream(chat_inputs(text, **forwarded), request_id=request_id)
            except ChatError as exc:
                self.stats.failed += 1
                if not exc.is_client_error:
                    self.serving.mark_failed(backend)
                    if not backend.healthy:
                        raise ChatError(
                            f"{self.serving.role} server {backend.url} is unavailable: {exc}", ErrorCode.UNAVAILABLE
                        ) from exc
                raise


class ServerFront(ChatFront):
    """One pdchat server's `chat` behind the OpenAI front, as vLLM serves one engine: for a
    router of its own (vllm-router, production-stack) that drives P/D itself. The body goes
    as is, `kv_transfer_params` included; a prefill answer carries them back in its JSON."""

    def __init__(self, url: str, role: str = "server"):
        super().__init__(BackendPool([url], role))

    def chat(self, body: dict[str, Any], request_id: str = "") -> Iterator[ChatOutput]:
        self.stats.requests += 1
        text, _ = self._validated(body)
        yield from self._stream(text, request_id or f"pdchat-{uuid.uuid4().hex}")


class PDRouter(ChatFront):
    """Prefill on one pool, decode on another. `forward_ids=False` is the comparison mode of
    the benchmarks (vLLM before it forwarded ids): decode gets the signed handoff without
    the ids and renders itself."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], forward_ids: bool = True):
        super().__init__(BackendPool(decode_urls, "decode"))
        self.prefill = BackendPool(prefill_urls, "prefill")
        self.decode = self.serving
        self.forward_ids = forward_ids

    def chat(self, body: dict[str, Any], request_id: str = "") -> Iterator[ChatOutput]:
        """The decode server's responses for one chat request (streamed if body asks)."""
        request_id = request_id or f"pdchat-{uuid.uuid4().hex}"
        self.stats.requests += 1
        text, chat = self._validated(body)
        if chat.kv_transfer_params is not None:
            raise ChatError(
                "kv_transfer_params is the router's to set: send the conversation only", ErrorCode.INVALID_ARG
            )
        if not self.decode.any_healthy():
            # Prefill work for a request no decode server can finish would only pile up KV.
            self.stats.failed += 1
            raise self.decode.none_ready()
        prefilled = self._prefill_leg(text, request_id)
        forwarded = {}
        if prefilled is not None:
            # The signed handoff goes on as the prefill server serialized it.
            forwarded = {"kv_transfer_params": prefilled.kv_transfer_params_json}
            if self.forward_ids:
                forwarded["prompt_token_ids"] = prefilled.prompt_token_ids
            self.stats.disaggregated += 1
        yield from self._stream(text, request_id, **forwarded)

    def _prefill_leg(self, body: bytes, request_id: str) -> ChatOutput | None:
        """Prefill's answer (first token, prompt ids, signed handoff), or None to let decode
        do it all. A do_remote_decode request gets one answer, streamed or not."""
        started = time.perf_counter()
        used = None
        try:
            with self.prefill.pick() as used, used.client() as client:
                inputs = chat_inputs(body, kv_transfer_params={"do_remote_decode": True})
                [output] = list(client.stream(inputs, request_id=request_id))
            log.info(
                "request %s: prefill on %s in %.1f ms", request_id, used.url, 1000 * (time.perf_counter() - started)
            )
            return output
        except ChatError as exc:
            if exc.is_client_error:
                raise  # the request itself is bad: decode would refuse it too
            if used is not None:
                self.prefill.mark_failed(used)
            self.stats.prefill_fallbacks += 1
            log.warning("request %s: prefill failed (%s: %s); decode serves it whole", request_id, exc.code.name, exc)
            return None

    def health(self) -> dict[str, Any]:
        return {**super().health(), "prefill": {b.url: b.probe() for b in self.prefill.backends}}


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


def stream_completion(router_url: str, body: dict[str, Any], timeout: float = 600.0) -> Iterator[dict[str, Any]]:
    """Client side of the router API: the chunks of a streamed chat completion (SSE)."""
    import urllib.request

    request = urllib.request.Request(
        f"{router_url}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        for line in reply:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:  # its code: an ErrorCode's gRPC status name (openai_api.chat_api_error)
                    error = chunk["error"]
                    raise ChatError(error["message"], ErrorCode.from_grpc_status(error.get("code", "")))
                yield chunk
