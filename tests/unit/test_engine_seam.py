"""The engine seam (core.engine_api) without a server: a prompt prefilled by one engine and
decoded by another from its exported KV gives the tokens the decode engine gives computing
the prompt itself; a cancelled request ends cancelled; a grammar that does not compile fails
its request; the engine names its execution path."""

import queue
from concurrent.futures import Future

import pytest

from pdchat.core.engine_api import (
    DECODE,
    PREFILL,
    DecodeCallbacks,
    DecodeRequest,
    EngineHooks,
    PrefillRequest,
)
from pdchat.core.engines import open_engine
from pdchat.core.errors import InvalidRequest
from pdchat.core.kv.base import KV_TOKEN_AXIS
from pdchat.core.request.protocol import GenerationParams
from pdchat.models import resolve_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    settings = resolve_model({"model": str(tiny_model_dir), "device": "cpu"}, {})
    prefill = open_engine(PREFILL, settings, {}, "prefill_0")
    decode = open_engine(DECODE, settings, {}, "decode_0")
    prefill.start()
    states = []
    decode.start(EngineHooks(on_state=states.append))
    yield prefill, decode
    prefill.close()
    decode.close()


class _Answer:
    """One decode request's callbacks, collected."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ended: Future = Future()
        self.started = False
        self.deltas: queue.SimpleQueue = queue.SimpleQueue()

    def callbacks(self) -> DecodeCallbacks:
        return DecodeCallbacks(
            started=lambda: setattr(self, "started", True),
            emit=self._emit,
            fail=self.ended.set_exception,
            cancelled=lambda: self.ended.set_result("cancelled"),
        )

    def _emit(self, delta) -> None:
        self.tokens.extend(delta.token_ids)
        self.deltas.put(delta)
        if delta.finish_reason:
            self.ended.set_result(delta.finish_reason)


def _params(key: str, **options) -> GenerationParams:
    return GenerationParams(max_tokens=options.pop("max_tokens", 8), request_id=key, ignore_eos=True, **options)


def test_prefill_then_decode_from_its_kv_gives_what_decode_alone_gives(engines):
    prefill, decode = engines
    prefilled: Future = Future()
    prefill.prefill(PrefillRequest(PROMPT, _params("p")), prefilled.set_result, prefilled.set_exception)
    result = prefilled.result(timeout=60)
    assert result.kv.shape[KV_TOKEN_AXIS] == len(PROMPT)

    released = []
    handed = _Answer()
    decode.decode(
        DecodeRequest(
            "handed",
            PROMPT,
            _params("handed"),
            first=result.first,
            kv_source=lambda start: result.kv[(slice(None),) * KV_TOKEN_AXIS + (slice(start, None),)],
            on_kv_released=lambda: released.append(True),
        ),
        handed.callbacks(),
    )
    alone = _Answer()
    decode.decode(DecodeRequest("alone", PROMPT, _params("alone")), alone.callbacks())
    assert handed.ended.result(timeout=60) == alone.ended.result(timeout=60) == "length"
    assert handed.tokens == alone.tokens and len(handed.tokens) == 8
    assert handed.tokens[0] == result.first.token_id
    assert handed.started and released == [True]
    assert decode.pool_usage().used_blocks == 0  # both ended: their blocks went back


def test_a_cancelled_request_ends_cancelled(engines):
    _, decode = engines
    answer = _Answer()
    decode.decode(DecodeRequest("long", PROMPT, _params("long", max_tokens=500)), answer.callbacks())
    answer.deltas.get(timeout=60)  # running
    decode.cancel("long")
    assert answer.ended.result(timeout=60) == "cancelled"


def test_a_grammar_that_does_not_compile_fails_its_request(engines):
    prefill, _ = engines
    failed: Future = Future()
    params = _params("bad", constraint={"type": "json_schema", "schema": {"type": "no-such-type"}})
    prefill.prefill(PrefillRequest(PROMPT, params), failed.set_result, failed.set_exception)
    with pytest.raises(InvalidRequest, match="no-such-type"):
        failed.result(timeout=120)


def test_each_engine_names_its_path(engines):
    for engine in engines:
        assert engine.path.forward == "llama" and engine.path.device == "cpu"
        assert engine.path.describe().startswith("own Llama forward")
        assert engine.kv_capacity_tokens > len(PROMPT) and engine.vocab_size > max(PROMPT)


def test_a_kv_prefetch_runs_before_the_request_is_queued_and_a_cancel_meanwhile_ends_it(engines):
    """The prefetch (a pull that waits on the network) runs on a thread of the engine's
    before the request is queued; a request cancelled while it waits ends cancelled, unstarted."""
    import threading

    _, decode = engines
    release, prefetching = threading.Event(), threading.Event()

    def prefetch():
        prefetching.set()
        release.wait(30)

    answer = _Answer()
    decode.decode(DecodeRequest("waits", PROMPT, _params("waits"), prefetch_kv=prefetch), answer.callbacks())
    assert prefetching.wait(30) and threading.current_thread() is threading.main_thread()
    decode.cancel("waits")
    release.set()
    assert answer.ended.result(timeout=60) == "cancelled" and not answer.started and not answer.tokens


def test_running_rows_keep_stepping_while_a_kv_pull_waits(engines):
    """Issue 57's item 3: a NIXL pull once waited on decode's scheduler thread, so no running
    row stepped until it came. A pull that waits 1.5 s now holds none of the running rows:
    a long answer gets tokens all through it, with no gap near the wait."""
    import threading
    import time

    _, decode = engines
    running = _Answer()
    decode.decode(DecodeRequest("runs", PROMPT, _params("runs", max_tokens=8000)), running.callbacks())
    running.deltas.get(timeout=60)
    pulling, in_pull = _Answer(), threading.Event()

    def slow_pull():
        in_pull.set()
        time.sleep(1.5)

    decode.decode(DecodeRequest("pulls", PROMPT, _params("pulls"), prefetch_kv=slow_pull), pulling.callbacks())
    assert in_pull.wait(30)
    arrivals, until = [], time.monotonic() + 1.4
    while time.monotonic() < until:
        running.deltas.get(timeout=5)
        arrivals.append(time.monotonic())
    decode.cancel("runs")
    assert pulling.ended.result(timeout=60) == "length" and len(pulling.tokens) == 8
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len(arrivals) > 20 and max(gaps) < 0.5, f"{len(arrivals)} tokens, longest gap {max(gaps):.2f} s"
    assert running.ended.result(timeout=60) == "cancelled"
