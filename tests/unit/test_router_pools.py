"""The router's server pools: a server that does not answer gets no requests, no request
waits for a probe, a server silent past the stall deadline is cancelled and marked unready
until a probe finds it ready, no prefill work starts while no decode server could
finish it, and a prefill leg's first output goes out as it arrives."""

import asyncio
import socket
import threading
import time

import pytest

from pdchat import tensors
from pdchat.clients import backend_pool
from pdchat.clients.backend_pool import BackendPool, Draining, UpstreamTimeout
from pdchat.clients.chat import ChatError, ChatOutput, chat_inputs
from pdchat.clients.router import PDRouter
from pdchat.core.errors import ErrorCode
from pdchat.launcher import free_port
from tests.integration.helpers import blocking, wait_for

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def unreachable() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


@pytest.fixture
def silent():
    """Addresses that accept connections and never answer, as a SIGSTOPped server does."""
    sockets = []

    def address() -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)  # the kernel completes the handshakes; nothing reads
        sockets.append(sock)
        return f"127.0.0.1:{sock.getsockname()[1]}"

    yield address
    for sock in sockets:
        sock.close()


class Probes:
    """The readiness probe: ready are the addresses in `ready`; each probe takes `delay_s`."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.delay_s = 0.0

    def __call__(self, url: str) -> bool:
        time.sleep(self.delay_s)
        return url in self.ready


@pytest.fixture
def probes(monkeypatch) -> Probes:
    probes = Probes()
    monkeypatch.setattr(backend_pool, "_ready", probes)
    return probes


def test_a_pool_of_unreachable_servers_refuses_with_unavailable():
    pool = BackendPool([unreachable(), unreachable()], "decode", reprobe_s=3600)
    pool.mark_failed(pool.backends[0])
    pool.mark_failed(pool.backends[1])
    with pytest.raises(ChatError) as info, pool.pick():
        pass
    assert info.value.code is ErrorCode.UNAVAILABLE and "no decode server is ready" in str(info.value)


def test_a_failed_server_is_skipped_while_another_is_healthy():
    pool = BackendPool([unreachable(), unreachable()], "decode", reprobe_s=3600)
    pool.mark_failed(pool.backends[0])  # probed: down, and not probed again for an hour
    picks = set()
    for _ in range(4):
        with pool.pick() as backend:
            picks.add(backend.url)
    assert picks == {pool.backends[1].url}


def test_an_unready_server_is_back_once_the_watcher_finds_it_ready(probes):
    pool = BackendPool(["a:1", "b:1"], "decode", reprobe_s=0.05)
    first, second = pool.backends
    pool.mark_unready(first)
    assert not first.healthy and second.healthy
    time.sleep(0.2)  # probed a few times meanwhile: still not ready
    with pool.pick() as backend:
        assert backend is second
    probes.ready.add("a:1")
    assert wait_for(lambda: first.healthy, timeout=5, interval=0.02)
    assert wait_for(lambda: pool._watcher is None, timeout=5, interval=0.02), "the watcher outlived the outage"
    pool.mark_unready(second)  # a later outage starts a watcher again
    probes.ready.add("b:1")
    assert wait_for(lambda: second.healthy and pool._watcher is None, timeout=5, interval=0.02)


def test_no_request_waits_for_a_probe(probes):
    probes.delay_s = 2.0  # a stopped server holds each probe for its whole timeout
    pool = BackendPool(["a:1", "b:1"], "decode", reprobe_s=0.05)
    for backend in pool.backends:
        pool.mark_unready(backend)
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(ChatError) as info, pool.pick():
            pass
        assert info.value.code is ErrorCode.UNAVAILABLE and "no decode server is ready (a:1, b:1)" in str(info.value)
    assert time.monotonic() - started < 0.5


def test_a_silent_server_ends_the_stream_at_the_stall_deadline_and_is_marked_unready(silent):
    pool = BackendPool([silent()], "decode", reprobe_s=3600, stall_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout) as info, pool.pick() as backend:
        list(blocking(pool.stream(backend, chat_inputs(HI))))
    assert 0.5 <= time.monotonic() - started < 2.0
    assert str(info.value) == (
        f"decode server {backend.url} sent nothing for 0.5 s (setting stall_timeout_s); the request was cancelled"
    )
    assert info.value.code is ErrorCode.UNAVAILABLE and not backend.healthy
    assert backend.idle.empty(), "the client of a stalled stream was kept for reuse"
    with pytest.raises(ChatError, match="no decode server is ready"), pool.pick():
        pass


def test_a_stalled_prefill_leg_falls_back_to_decode_and_a_stalled_decode_is_a_timeout(silent):
    router = PDRouter([silent()], [silent()], stall_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="^decode server"):
        list(blocking(router.chat(HI)))
    assert 0.6 <= time.monotonic() - started < 3.0, "one stall deadline per leg"
    assert router.stats.prefill_fallbacks == 1 and router.stats.failed == 1
    assert not router.prefill.backends[0].healthy and not router.decode.backends[0].healthy
    started = time.monotonic()
    with pytest.raises(ChatError, match="no decode server is ready"):
        list(blocking(router.chat(HI)))
    assert time.monotonic() - started < 0.5


def test_abort_ends_running_streams_with_draining_and_refuses_new_ones(silent):
    router = PDRouter([silent()], [silent()], stall_timeout_s=30)
    router.prefill.mark_unready(router.prefill.backends[0])  # straight to decode
    ended: list[BaseException] = []

    def run() -> None:
        try:
            list(blocking(router.chat(HI)))
        except ChatError as exc:
            ended.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_for(lambda: router.decode._streams, timeout=5, interval=0.02), "the stream never started"
    started = time.monotonic()
    router.abort("stopping")
    thread.join(5)
    assert time.monotonic() - started < 2.0
    assert len(ended) == 1 and isinstance(ended[0], Draining) and str(ended[0]) == "stopping"
    assert router.decode.backends[0].healthy, "an aborted stream is no fault of its server"
    with pytest.raises(Draining, match="stopping"):
        list(blocking(router.chat(HI)))


def test_no_prefill_leg_starts_while_no_decode_server_is_ready():
    router = PDRouter([unreachable()], [unreachable()])
    router.decode.mark_failed(router.decode.backends[0])
    with pytest.raises(ChatError) as info:
        list(blocking(router.chat({"messages": [{"role": "user", "content": "hi"}]})))
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert router.stats.prefill_fallbacks == 0 and router.prefill.backends[0].checked_at == 0.0, "prefill was tried"


class PrefillLeg:
    """A prefill server's stream to the router's prefill leg: a first output, then (once
    `release` is set) the answer, or `failure` in its place; and a decode leg that records
    the parameters it was started with."""

    def __init__(self, router: PDRouter, failure: ChatError | None = None):
        self.release, self.failure, self.decode_parameters = threading.Event(), failure, []
        router.prefill.stream = self.stream
        router._stream = self.decode

    async def stream(self, used, inputs, request_id, parameters):
        yield ChatOutput(text="first", response_json="{}")
        while not self.release.is_set():  # as a server's next response, awaited on the loop
            await asyncio.sleep(0.01)
        if self.failure is not None:
            raise self.failure
        yield ChatOutput(text="", response_json="{}", prompt_token_ids=[1, 2], kv_transfer_params_json='{"k": 1}')

    async def decode(self, text, request_id, form, parameters, **forwarded):
        self.decode_parameters.append((parameters, forwarded))
        yield ChatOutput(text="rest", response_json="{}")


def test_the_prefill_legs_first_output_goes_out_before_its_answer_arrives(probes):
    router = PDRouter([unreachable()], [unreachable()], forward_ids=True)
    probes.ready.update(backend.url for backend in (*router.prefill.backends, *router.decode.backends))
    leg = PrefillLeg(router)
    outputs = blocking(router.chat(HI))
    assert next(outputs).text == "first" and not leg.release.is_set()
    leg.release.set()
    assert [output.text for output in outputs] == ["rest"]
    [(parameters, forwarded)] = leg.decode_parameters
    assert parameters == {tensors.FIRST_OUTPUT_SENT: True}
    assert forwarded == {"kv_transfer_params": '{"k": 1}', "prompt_token_ids": [1, 2]}


def test_a_prefill_leg_failing_after_its_first_output_ends_the_request_not_falls_back(probes):
    router = PDRouter([unreachable()], [unreachable()], forward_ids=True)
    probes.ready.update(backend.url for backend in (*router.prefill.backends, *router.decode.backends))
    leg = PrefillLeg(router, failure=ChatError("prefill died", ErrorCode.UNAVAILABLE))
    leg.release.set()
    outputs = blocking(router.chat(HI))
    assert next(outputs).text == "first"
    with pytest.raises(ChatError, match="prefill died"):
        next(outputs)
    assert router.stats.prefill_fallbacks == 0 and leg.decode_parameters == []
