"""P/D router: prefill on one server, decode on another, one OpenAI-compatible front.

`PDRouter` (library) drives the two legs over tritonclient gRPC: the prefill server's
`chat` renders, prefills and answers signed kv_transfer_params; the decode server's
`chat` gets the same request plus those params and the ids as a binary tensor, so it
neither renders nor tokenizes. Fallbacks lose no request: prefill unreachable, failing
or stalled -> decode serves the request whole; decode unreachable -> a clear error.

A server that sends nothing for `stall_timeout_s` (setting STALL_TIMEOUT_S) ends its
stream with UpstreamTimeout, its request cancelled, and gets no new request until it
answers a readiness probe again (`BackendPool`).

`pdchat.clients.openai_api` puts it behind `POST /v1/chat/completions` and
`POST /v1/completions` (SSE when streaming), `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET /health`, `GET /metrics` and `POST /drain`, for
the `openai` client or curl.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pdchat import tensors
from pdchat.clients.affinity import PrefixAffinity, prefix_keys
from pdchat.clients.chat import ChatError, ChatOutput, GrpcChat, ServerSilent, Waiting, chat_inputs
from pdchat.clients.kv_index import BlockIndex, KVEventSource, KVEventSubscriber
from pdchat.core.errors import ErrorCode, InvalidRequest
from pdchat.core.request.protocol import (
    ChatRequest,
    chat_request_from_body,
    check_served_model,
    completion_request_from_body,
    utf8_json,
)
from pdchat.core.request.tokenize import parse_detokenize, parse_tokenize
from pdchat.core.settings import DECODE_DIRECT, KV_BLOCK_TOKENS, STALL_TIMEOUT_S

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("pdchat.router")
PROBE_TIMEOUT_S = 2.0
# The `chat` input a body travels as (chat completions, completions), and how the front
# validates it first (without the grammar compiler: the router has no torch).
BODY_VALIDATORS = {
    tensors.REQUEST: functools.partial(chat_request_from_body, check_grammar=False),
    tensors.COMPLETION_REQUEST: completion_request_from_body,
}


class UpstreamTimeout(ChatError):
    """A server sent nothing for the stall deadline (before its first response or between
    two): its request was cancelled and the server marked unready."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.UNAVAILABLE)


class ClientLeft(ChatError):
    """The client of this request left: the front cancelled its streams (`RequestStreams.cancel`)."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id}: the client left; it was cancelled", ErrorCode.UNAVAILABLE)


class RequestStreams:
    """The streams one client request opened, one after another (prefill's, then decode's)
    or n at once: once its client left, `cancel()` (from any thread) ends them with
    ClientLeft, cancelled on their servers, and any it would open after. Each HTTP request
    has its own: no id a client sends can reach another's.

    `on_arrival`: called (on the streams' loop, StreamLoop) when a response of one of them arrives; with
    `waiting`, a front on an event loop takes a stream's outputs as they come without
    a thread waiting for each (clients/openai_api.py)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.on_arrival: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._clients: set[GrpcChat] = set()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            clients = list(self._clients)
        _cancel_streams(clients, "a request whose client left")

    def waiting(self) -> Waiting:
        """What the one running stream's `next` would take now (GrpcChat.waiting); OTHER
        unless exactly one runs."""
        with self._lock:
            if len(self._clients) != 1:
                return Waiting.OTHER
            [client] = self._clients
        return client.waiting()

    def _arrived(self) -> None:
        if (on_arrival := self.on_arrival) is not None:  # set once the front reads the stream
            on_arrival()

    @contextmanager
    def holding(self, client: GrpcChat, request_id: str) -> Iterator[None]:
        """`client`'s stream is this request's while inside; ClientLeft at once if it was cancelled."""
        with self._lock:
            if self.cancelled:
                raise ClientLeft(request_id)
            self._clients.add(client)
            client.on_arrival = self._arrived
        try:
            yield
        finally:
            with self._lock:
                self._clients.discard(client)
                client.on_arrival = None


def _cancel_streams(clients: list[GrpcChat], whose: str) -> None:
    for client in clients:
        try:
            client.cancel()
        except Exception:  # noqa: BLE001 - a stream ending meanwhile races tritonclient's stop
            log.debug("a stream of %s ended while it was being cancelled", whose, exc_info=True)


class Draining(ChatError):
    """The front is draining: it ended this stream (its request cancelled on its server) or
    takes no new ones. The message says why."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.UNAVAILABLE)


@dataclass
class Backend:
    """One tritonserver (gRPC address): its idle clients, requests in flight, and whether
    it is ready (as its last probe or request found it)."""

    url: str
    stall_timeout_s: float = STALL_TIMEOUT_S.default_value  # its clients' longest wait for a response
    outputs: tuple[str, ...] | None = None  # what its streams request (None: every output)
    decode_direct: bool = False  # its streams take tickets and stream from decode (GrpcChat)
    in_flight: int = 0
    idle: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    healthy: bool = True
    checked_at: float = 0.0

    @contextmanager
    def client(self) -> Iterator[GrpcChat]:
        try:
            chat = self.idle.get_nowait()
        except queue.Empty:
            chat = GrpcChat(
                self.url, timeout_s=self.stall_timeout_s, outputs=self.outputs, decode_direct=self.decode_direct
            )
        try:
            yield chat
        except BaseException:
            chat.close()  # a client that saw a broken stream is not reused
            raise
        chat.forget_cancel()  # no request holds it now (RequestStreams, BackendPool)
        self.idle.put(chat)


class BackendPool:
    """Least-loaded choice (fewest requests in flight) among the ready servers, round-robin
    among equals, and the streams of their requests (`stream`).

    How a server's readiness changes:
    - a transport failure or server fault probes it at once (`mark_failed`);
    - a stall (nothing for `stall_timeout_s`) marks it unready without a probe
      (`mark_unready`): a stopped server would hold the probe for its whole timeout;
    - while a server is unready, a watcher thread probes it every `reprobe_s` and marks it
      ready once it answers; `/health` probes every server.

    NOTE: no request waits for a probe: a request that finds no server ready is refused at
    once (`none_ready`). `decode_direct`: the streams stream from decode itself (setting
    DECODE_DIRECT; GrpcChat)."""

    def __init__(
        self,
        urls: list[str],
        role: str = "",
        reprobe_s: float = 1.0,
        stall_timeout_s: float | None = None,
        outputs: tuple[str, ...] | None = None,
        decode_direct: bool = False,
    ):
        if not urls:
            raise ValueError("a pool needs at least one server")
        self.stall_timeout_s = STALL_TIMEOUT_S.get() if stall_timeout_s is None else stall_timeout_s
        self.backends = [Backend(u, self.stall_timeout_s, outputs, decode_direct) for u in urls]
        self.role = role
        self.reprobe_s = reprobe_s
        self.aborted: str | None = None  # why `abort` ended the streams; no new one starts then
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._streams: set[GrpcChat] = set()  # clients whose stream runs
        self.on_unready: Callable[[str], None] | None = None

    @property
    def servers(self) -> str:
        """What messages call this pool's servers: "decode server", "server" (a front's one)."""
        return "server" if self.role in ("", "server") else f"{self.role} server"

    def any_healthy(self) -> bool:
        """Whether some server is ready now (as last found: this never probes)."""
        return any(b.healthy for b in self.backends)

    def mark_failed(self, backend: Backend) -> None:
        """A transport failure or server fault: probe it now, before it gets more requests."""
        self._found(backend, _ready(backend.url))

    def mark_unready(self, backend: Backend) -> None:
        """No new request for `backend` until the watcher's probe finds it ready."""
        self._found(backend, False)

    def probe_all(self) -> dict[str, bool]:
        """Probe every server now: whether each is ready, by address."""
        for backend in self.backends:
            self._found(backend, _ready(backend.url))
        return {b.url: b.healthy for b in self.backends}

    def none_ready(self) -> ChatError:
        """What a request gets while no server of the pool is ready."""
        return ChatError(
            f"no {self.servers} is ready ({', '.join(b.url for b in self.backends)})",
            ErrorCode.UNAVAILABLE,
        )

    @contextmanager
    def pick(self, choose: Callable[[dict[str, int]], str] | None = None) -> Iterator[Backend]:
        """A ready server for one request, counted in flight while the context lasts: the
        least loaded, or the one `choose` names given the ready servers' requests in flight."""
        if not self.any_healthy():
            raise self.none_ready()
        with self._lock:
            start = next(self._turn)
            order = self.backends[start % len(self.backends) :] + self.backends[: start % len(self.backends)]
            ready = [b for b in order if b.healthy] or order
            if choose is None:
                backend = min(ready, key=lambda b: b.in_flight)
            else:
                url = choose({b.url: b.in_flight for b in ready})
                backend = next(b for b in ready if b.url == url)
            backend.in_flight += 1
        try:
            yield backend
        finally:
            with self._lock:
                backend.in_flight -= 1

    def stream(
        self,
        backend: Backend,
        inputs: dict[str, np.ndarray],
        request_id: str = "",
        streams: RequestStreams | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> Iterator[ChatOutput]:
        """`backend`'s responses (it comes from `pick`) to one request (`parameters`: chat's
        request parameters, GrpcChat.stream). Its errors, by kind:
        - nothing for `stall_timeout_s`: UpstreamTimeout, naming the server; the request is
          cancelled and the server marked unready;
        - a transport failure or server fault: the server is probed at once; one that does
          not answer ends the stream UNAVAILABLE, naming it;
        - once `abort` ran: Draining, the request cancelled;
        - once `streams` was cancelled: ClientLeft, the request cancelled.
        A client error (the request is bad) ends it as the server said."""
        streams = streams or RequestStreams()
        with backend.client() as client, self._running(client), streams.holding(client, request_id):
            try:
                yield from client.stream(inputs, request_id=request_id, parameters=parameters)
            except Exception as exc:
                if streams.cancelled:  # we closed the stream: the server did nothing wrong
                    raise ClientLeft(request_id) from exc
                error = self._failure(backend, exc)
                if error is exc:
                    raise
                raise error from exc

    def abort(self, reason: str) -> None:
        """End every running stream with Draining(reason), its request cancelled on its
        server (the gRPC stream closed), and refuse new streams from now on."""
        with self._lock:
            self.aborted = reason
            streams = list(self._streams)
        _cancel_streams(streams, f"the {self.role or 'backend'} pool being aborted")

    @contextmanager
    def _running(self, client: GrpcChat) -> Iterator[None]:
        """`client`'s stream counts as running (for `abort`) while inside."""
        with self._lock:
            if self.aborted is not None:
                raise Draining(self.aborted)
            self._streams.add(client)
        try:
            yield
        finally:
            with self._lock:
                self._streams.discard(client)

    def _failure(self, backend: Backend, exc: Exception) -> Exception:
        """What a stream of `backend` that raised `exc` ends with; the server's readiness updated."""
        if self.aborted is not None:  # the closed stream may surface as any of tritonclient's errors
            return Draining(self.aborted)
        if isinstance(exc, ServerSilent):  # GrpcChat waited its timeout for a response
            self.mark_unready(backend)
            stall = UpstreamTimeout(
                f"{self.servers} {backend.url} sent nothing for {self.stall_timeout_s:g} s "
                "(setting stall_timeout_s); the request was cancelled"
            )
            log.warning("%s; no new requests for it until it answers a readiness probe", stall)
            return stall
        if isinstance(exc, ChatError) and not exc.is_client_error:
            self.mark_failed(backend)
            if not backend.healthy:
                return ChatError(f"{self.servers} {backend.url} is unavailable: {exc}", ErrorCode.UNAVAILABLE)
        return exc

    def _found(self, backend: Backend, ready: bool) -> None:
        """Record what a probe or a request found; an unready server starts the watcher (and
        `on_unready` hears of it: a server that comes back may have restarted, its cache empty)."""
        if not ready and backend.healthy and self.on_unready is not None:
            self.on_unready(backend.url)
        with self._lock:
            backend.healthy, backend.checked_at = ready, time.monotonic()
            if not ready and self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name=f"pdchat-probe-{self.role}", daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        """Probe the unready servers every `reprobe_s` until every server is ready."""
        while True:
            time.sleep(self.reprobe_s)
            with self._lock:
                unready = [b for b in self.backends if not b.healthy]
                if not unready:
                    self._watcher = None
                    return
            for backend in unready:
                ready = _ready(backend.url)
                if ready:
                    log.info("%s %s is ready again", self.servers, backend.url)
                self._found(backend, ready)


@dataclass
class RouterStats:
    requests: int = 0
    disaggregated: int = 0
    prefill_fallbacks: int = 0
    failed: int = 0


class ChatFront:
    """What the OpenAI HTTP front (clients/openai_api.py) serves: chat requests streamed from
    the `chat` model of a pool of servers, the served model names, health and stats.

    `served_model_names` (--served-model-name): the names a request's `model` may give,
    checked here (ModelNotFound: 404 model_not_found) and listed by /v1/models; they must be
    among the servers' own (setting SERVED_MODEL_NAME), which check them again. None given:
    the name a server reports, and the servers alone check."""

    def __init__(self, serving: BackendPool, served_model_names: Sequence[str] = ()):
        self.serving = serving
        self.stats = RouterStats()
        self.served_model_names = tuple(served_model_names)
        self._served_model: str | None = None

    @property
    def pools(self) -> tuple[BackendPool, ...]:
        """Every pool this front streams from."""
        return (self.serving,)

    def chat(
        self,
        body: dict[str, Any],
        request_id: str = "",
        form: str = tensors.REQUEST,
        streams: RequestStreams | None = None,
    ) -> Iterator[ChatOutput]:
        """The responses to one body of the API `form` names (a BODY_VALIDATORS key: chat
        completions, or completions), streamed if it asks; ClientLeft once `streams`
        was cancelled."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """End every running stream with Draining(reason), cancelling its request on its
        server; streams asked for later end so at once."""
        for pool in self.pools:
            pool.abort(reason)

    def served_models(self) -> tuple[str, ...]:
        """The model names clients may send, the one reported first."""
        return self.served_model_names or (self.served_model(),)

    def served_model(self) -> str:
        """The model name answers report: the first served name, else asked of a server once."""
        if self.served_model_names:
            return self.served_model_names[0]
        if self._served_model is None:
            probe = chat_inputs({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            with self.serving.pick() as backend:
                [answer] = list(self.serving.stream(backend, probe))
            self._served_model = answer.response["model"]
        return self._served_model

    @property
    def renderer_pools(self) -> tuple[BackendPool, ...]:
        """The pools whose renderer answers /tokenize and /detokenize, in order of preference."""
        return (self.serving,)

    def tokenize(self, body: dict[str, Any], request_id: str = "") -> dict[str, Any]:
        """vLLM's /tokenize answer (pdchat.core.request.tokenize): a server's renderer model
        renders a chat as it renders that chat completion, so the ids are those chat computes."""
        self._checked(parse_tokenize, body)
        return self._renderer_answer(tensors.TOKENIZE_REQUEST, body, request_id)

    def detokenize(self, body: dict[str, Any], request_id: str = "") -> dict[str, Any]:
        """vLLM's /detokenize answer: the ids' text, by a server's tokenizer."""
        self._checked(parse_detokenize, body)
        return self._renderer_answer(tensors.DETOKENIZE_REQUEST, body, request_id)

    def health(self) -> dict[str, Any]:
        status = {self.serving.role: self.serving.probe_all(), "stats": self.stats.__dict__}
        status["ok"] = any(status[self.serving.role].values())
        return status

    def _validated(self, body: dict[str, Any], form: str) -> tuple[bytes, ChatRequest]:
        """The body as the bytes every server gets as input `form`, once it is known valid
        here (a bad request is the client's error, never a server failure)."""
        try:
            chat = BODY_VALIDATORS[form](body)
            if self.served_model_names:
                check_served_model(chat.model, self.served_model_names)
            return utf8_json(body), chat
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc

    def _checked(self, parse: Any, body: dict[str, Any]) -> Any:
        """`parse(body)`, and its model among the served names where this front has them;
        a bad body is the client's error."""
        try:
            request = parse(body)
            if self.served_model_names:
                check_served_model(request.model, self.served_model_names)
            return request
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc

    def _renderer_answer(self, name: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """The renderer's JSON answer to `body` as input `name`, from the first pool with a
        ready server (errors as `BackendPool.stream` says, but for stalls: its client's timeout)."""
        try:
            text = utf8_json(body)
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc
        pool = next((p for p in self.renderer_pools if p.any_healthy()), self.renderer_pools[0])
        with pool.pick() as backend, backend.client() as client:
            try:
                return client.answer(tensors.RENDERER, name, text, request_id or f"pdchat-{uuid.uuid4().hex}")
            except ChatError as exc:
                error = pool._failure(backend, exc)
                if error is exc:
                    raise
                raise error from exc

    def _stream(
        self,
        text: bytes,
        request_id: str,
        form: str,
        streams: RequestStreams | None = None,
        parameters: dict[str, Any] | None = None,
        **forwarded: Any,
    ) -> Iterator[ChatOutput]:
        """Responses of one serving server to `text` as input `form` (errors as `BackendPool.stream` says)."""
        if not self.serving.any_healthy():
            self.stats.failed += 1
            raise self.serving.none_ready()
        with self.serving.pick() as backend:
            try:
                inputs = chat_inputs(text, form=form, **forwarded)
                yield from self.serving.stream(backend, inputs, request_id, streams, parameters)
            except ClientLeft:
                raise  # not a failure: nobody waits for it
            except ChatError:
                self.stats.failed += 1
                raise


class ServerFront(ChatFront):
    """One pdchat server's `chat` behind the OpenAI front, as vLLM serves one engine: for a
    router of its own (vllm-router, production-stack) that drives P/D itself. The body goes
    as is, `kv_transfer_params` included; a prefill answer carries them back in its JSON.
    `decode_direct`: answers stream from the server's decode model itself (None: setting DECODE_DIRECT)."""

    def __init__(
        self,
        url: str,
        role: str = "server",
        stall_timeout_s: float | None = None,
        served_model_names: Sequence[str] = (),
        outputs: tuple[str, ...] | None = None,
        decode_direct: bool | None = None,
    ):
        direct = DECODE_DIRECT.get() if decode_direct is None else decode_direct
        pool = BackendPool([url], role, stall_timeout_s=stall_timeout_s, outputs=outputs, decode_direct=direct)
        super().__init__(pool, served_model_names)

    def chat(
        self,
        body: dict[str, Any],
        request_id: str = "",
        form: str = tensors.REQUEST,
        streams: RequestStreams | None = None,
    ) -> Iterator[ChatOutput]:
        self.stats.requests += 1
        text, _ = self._validated(body, form)
        yield from self._stream(text, request_id or f"pdchat-{uuid.uuid4().hex}", form, streams)


class PDRouter(ChatFront):
    """Prefill on one pool, decode on another. `forward_ids=False` is the comparison mode of
    the benchmarks (vLLM before it forwarded ids): decode gets the signed handoff without
    the ids and renders itself. `stall_timeout_s`: None reads the setting. `policy` picks
    the prefill server: `prefix` (a conversation's next turn goes where its prefix is
    cached, clients/affinity.py) or `least-loaded`.

    `kv_events`: the prefill servers (by address) whose KV events the prefix policy reads,
    each on a subscriber thread of its own, so what a server evicted no longer draws a
    conversation there (clients/kv_index.py); blocks of `kv_event_block_size` tokens (None:
    setting KV_BLOCK_TOKENS, as the servers read it). `outputs`: what its streams request of
    chat (None: every output; the HTTP fronts request tensors.FRONT_OUTPUTS); `decode_direct`:
    decode servers' answers stream from their decode model itself (None: setting DECODE_DIRECT).
    Call close() to stop the subscribers."""

    POLICIES = ("prefix", "least-loaded")

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        forward_ids: bool = True,
        stall_timeout_s: float | None = None,
        served_model_names: Sequence[str] = (),
        policy: str = "prefix",
        kv_events: dict[str, KVEventSource] | None = None,
        kv_event_block_size: int | None = None,
        outputs: tuple[str, ...] | None = None,
        decode_direct: bool | None = None,
    ):
        if policy not in self.POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(self.POLICIES)}, got {policy!r}")
        kv_events = kv_events or {}
        if kv_events and policy != "prefix":
            raise ValueError("KV events feed the prefix policy: they need policy prefix")
        if unknown := sorted(set(kv_events) - set(prefill_urls)):
            raise ValueError(f"KV events of {', '.join(unknown)}, which is no prefill server here")
        direct = DECODE_DIRECT.get() if decode_direct is None else decode_direct
        decode = BackendPool(
            decode_urls, "decode", stall_timeout_s=stall_timeout_s, outputs=outputs, decode_direct=direct
        )
        super().__init__(decode, served_model_names)
        # A prefill leg's answer also gives the prompt ids the decode leg is forwarded.
        prefill_outputs = None if outputs is None else tuple(dict.fromkeys((*outputs, tensors.PROMPT_TOKEN_IDS)))
        self.prefill = BackendPool(prefill_urls, "prefill", stall_timeout_s=stall_timeout_s, outputs=prefill_outputs)
        self.decode = self.serving
        self.forward_ids = forward_ids
        block_size = KV_BLOCK_TOKENS.get() if kv_event_block_size is None else kv_event_block_size
        self.kv_indexes = {url: BlockIndex(block_size) for url in kv_events}
        self.affinity = PrefixAffinity(indexes=self.kv_indexes) if policy == "prefix" else None
        if self.affinity is not None:
            self.prefill.on_unready = self.affinity.forget
        self._subscribers = [
            KVEventSubscriber(
                self.kv_indexes[url],
                source.endpoint,
                source.replay_endpoint,
                on_reset=functools.partial(self.affinity.forget, url),
            )
            for url, source in kv_events.items()
        ]

    @property
    def pools(self) -> tuple[BackendPool, ...]:
        return (self.prefill, self.decode)

    @property
    def renderer_pools(self) -> tuple[BackendPool, ...]:
        """Prefill's renderers (they render the chat requests), decode's while none is ready."""
        return (self.prefill, self.decode)

    def chat(
        self,
        body: dict[str, Any],
        request_id: str = "",
        form: str = tensors.REQUEST,
        streams: RequestStreams | None = None,
    ) -> Iterator[ChatOutput]:
        """The decode server's responses for one chat or completions request (streamed if body asks)."""
        request_id = request_id or f"pdchat-{uuid.uuid4().hex}"
        self.stats.requests += 1
        text, chat = self._validated(body, form)
        for routers_own in ("kv_transfer_params", "prompt_token_ids"):
            if getattr(chat, routers_own) is not None:
                message = f"{routers_own} is the router's to set: send the conversation only"
                raise ChatError(message, ErrorCode.INVALID_ARG)
        if not self.decode.any_healthy():
            # Prefill work for a request no decode server can finish would only pile up KV.
            self.stats.failed += 1
            raise self.decode.none_ready()
        keys = prefix_keys(body) if self.affinity is not None else []  # only the prefix policy reads them
        # The client has the first output as soon as prefill sent it; the decode leg's stream goes on after it.
        answer, first_sent = yield from self._prefill_leg(text, request_id, form, keys, streams)
        forwarded: dict[str, Any] = {}
        parameters: dict[str, Any] = {}
        if answer is not None:
            # The signed handoff goes on as the prefill server serialized it.
            forwarded = {"kv_transfer_params": answer.kv_transfer_params_json}
            if self.forward_ids:
                forwarded["prompt_token_ids"] = answer.prompt_token_ids
            self.stats.disaggregated += 1
            if first_sent:
                parameters[tensors.FIRST_OUTPUT_SENT] = True
        yield from self._stream(text, request_id, form, streams, parameters, **forwarded)

    def _prefill_leg(
        self, body: bytes, request_id: str, form: str, keys: list[bytes], streams: RequestStreams | None
    ) -> Generator[ChatOutput, None, tuple[ChatOutput | None, bool]]:
        """Yields the streamed answer's first output the moment the prefill server sends it
        (when it does); returns prefill's answer (first token, prompt ids, signed handoff) and
        whether that first output went out, or (None, False) to let decode do it all: no
        prefill server ready, or the one picked failed or stalled before the first output
        went out. A do_remote_decode request gets one answer (the response with
        kv_transfer_params), streamed or not, and with ids forwarded the first output before
        it (tensors.FIRST_OUTPUT_EARLY). `keys`: the request's prefix keys, for the prefix
        policy.

        NOTE: once the first output went out the request is this prefill's: a failure then
        ends it (decode alone would send the client a first output again)."""
        started = time.perf_counter()
        choose = None if self.affinity is None else functools.partial(self.affinity.choose, keys)
        first_sent = False
        try:
            with self.prefill.pick(choose) as used:
                inputs = chat_inputs(body, kv_transfer_params={"do_remote_decode": True}, form=form)
                # The first output may go before the decode leg only where the decode server takes
                # the handle as it is (REUSE): it continues the prefill leg's answer there.
                parameters = {tensors.FIRST_OUTPUT_EARLY: True} if self.forward_ids else None
                answer = None
                for output in self.prefill.stream(used, inputs, request_id, streams, parameters):
                    is_answer = bool(output.kv_transfer_params_json) or not self.forward_ids
                    if answer is not None or (first_sent and not is_answer):
                        raise ChatError(f"prefill server {used.url} answered more than a first output and an answer")
                    if is_answer:
                        answer = output
                    else:
                        first_sent = True
                        yield output
                if answer is None:
                    raise ChatError(f"prefill server {used.url} ended its stream without an answer")
            log.info(
                "request %s: prefill on %s in %.1f ms", request_id, used.url, 1000 * (time.perf_counter() - started)
            )
            index = self.kv_indexes.get(used.url)
            if index is not None and keys:  # its blocks are on that server now: affinity holds while they are
                self.affinity.bind(used.url, keys[-1], index.prompt_key(answer.prompt_token_ids))
            return answer, first_sent
        except ChatError as exc:
            if first_sent or exc.is_client_error or isinstance(exc, (Draining, ClientLeft)):
                # the request itself is bad (decode would refuse it too), the front stops, nobody
                # waits, or the client has this prefill's first output
                raise
            self.stats.prefill_fallbacks += 1
            log.warning("request %s: prefill failed (%s: %s); decode serves it whole", request_id, exc.code.name, exc)
            return None, False

    def health(self) -> dict[str, Any]:
        health = {**super().health(), "prefill": self.prefill.probe_all()}
        if self.affinity is not None:  # leading messages routed to a server that had them before
            health["stats"] = {
                **health["stats"],
                "prefix_matched_messages": self.affinity.matched_messages,
                "prefix_routed_messages": self.affinity.routed_messages,
            }
        if self.kv_indexes:  # what each server's KV events told
            health["kv_events"] = {
                url: {"blocks": len(index), **asdict(index.stats)} for url, index in self.kv_indexes.items()
            }
        return health

    def close(self) -> None:
        """Stop the KV event subscribers."""
        for subscriber in self._subscribers:
            subscriber.close()


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
                if "error" in chunk:  # its code: an ErrorCode's openai_code (openai_api.chat_api_error)
                    error = chunk["error"]
                    raise ChatError(error["message"], ErrorCode.from_openai_code(error.get("code", "")))
                yield chunk
