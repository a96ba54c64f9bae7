"""The servers of one role behind a front: which one takes a request, and the streams of
their requests.

`BackendPool` picks the least-loaded ready server (round-robin among equals) and streams a
request's responses from it (`BackendPool.stream`), turning what goes wrong into errors that
name the server. A server that sends nothing for `stall_timeout_s` (setting STALL_TIMEOUT_S)
ends its stream with UpstreamTimeout, its request cancelled, and gets no new request until it
answers a readiness probe again. `abort` (a front's drain) ends every running stream with
Draining.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdchat.clients.chat import ChatError, ChatStream, GrpcChat, ServerSilent
from pdchat.core.errors import ErrorCode
from pdchat.core.settings import STALL_TIMEOUT_S

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("pdchat.router")
PROBE_TIMEOUT_S = 2.0


class UpstreamTimeout(ChatError):
    """A server sent nothing for the stall deadline (before its first response or between
    two): its request was cancelled and the server marked unready."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.UNAVAILABLE)


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
        chat.forget_cancel()  # a cancel that came after its stream ended (BackendPool.abort)
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
    once (`none_ready`). `decode_direct`: the streams stream from decode itself (GrpcChat's
    tickets: the fronts' decode servers)."""

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

    async def stream(
        self,
        backend: Backend,
        inputs: dict[str, np.ndarray],
        request_id: str = "",
        parameters: dict[str, Any] | None = None,
    ) -> ChatStream:
        """`backend`'s responses (it comes from `pick`) to one request (`parameters`: chat's
        request parameters, GrpcChat.astream), on the running event loop. Its errors, by kind:
        - nothing for `stall_timeout_s`: UpstreamTimeout, naming the server; the request is
          cancelled and the server marked unready;
        - a transport failure or server fault: the server is probed at once (in a worker
          thread); one that does not answer ends the stream UNAVAILABLE, naming it;
        - once `abort` ran: Draining, the request cancelled.
        A client error (the request is bad) ends it as the server said. Closing or cancelling
        the stream cancels its request."""
        with backend.client() as client, self._running(client):
            try:
                async with aclosing(client.astream(inputs, request_id, parameters)) as outputs:
                    async for output in outputs:
                        yield output
            except Exception as exc:
                error = await self._failure(backend, exc)
                if error is exc:
                    raise
                raise error from exc

    def abort(self, reason: str) -> None:
        """End every running stream with Draining(reason), its request cancelled on its
        server (the gRPC stream closed), and refuse new streams from now on."""
        with self._lock:
            self.aborted = reason
            streams = list(self._streams)
        for client in streams:
            client.cancel()

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

    async def _failure(self, backend: Backend, exc: Exception) -> Exception:
        """What a stream of `backend` that raised `exc` ends with; the server's readiness
        updated (a probe runs in a worker thread: it may take PROBE_TIMEOUT_S)."""
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
            await asyncio.to_thread(self.mark_failed, backend)
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
