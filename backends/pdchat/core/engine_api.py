"""The engine seam: what the prefill and decode Triton models ask of the engine behind them.

A stage model (model_repository/prefill, model_repository/decode) validates a request,
hands it to its `Engine`, and turns what comes back into Triton responses; it knows nothing
of forward passes, schedulers, samplers or KV pools. An engine:

- prefills a prompt (`prefill`): the first output token and the prompt's KV, exported for a
  KV connector to carry to decode (`Prefilled`);
- decodes (`decode`): from prefill's first token and a source of its KV, or from the ids
  alone (the engine then computes the prompt itself), streaming `Delta`s to the request's
  callbacks until one carries a finish reason, a failure or a cancellation ends it;
- cancels a request by key (`cancel`), wherever it is (queued, prefilling, running);
- reports its KV pool (`pool_usage`), its limits (`context_length`, `vocab_size`,
  `kv_capacity_tokens`) and what computes it (`path`);
- makes a request's client outputs from its deltas (`assembler`, `first_output`).

Each request is one call and its callbacks: an engine may run its requests on a thread of
its own (pdchat's schedulers) or an event loop (an `AsyncLLM`), and calls the callbacks
there; they must not block (a stage model hands their work to its outbox thread). Errors
reach a request's `fail` as pdchat's errors (core.errors). No Triton import here.

pdchat.core.engines.open_engine builds the engine the settings choose.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from pdchat.core.generation.paged import BlockPool, PoolUsage
    from pdchat.core.generation.sampling import Choice
    from pdchat.core.output.responses import ClientOutput, Delta, ResponseAssembler
    from pdchat.core.request.protocol import GenerationParams

TRANSFORMERS, OWN_LLAMA = "transformers", "llama"  # pdchat's forward passes, as ExecutionPath names them
_FORWARD_NAMES = {TRANSFORMERS: "transformers forward", OWN_LLAMA: "own Llama forward"}


@dataclass(frozen=True)
class ExecutionPath:
    """What computes an engine's passes: its `forward` (pdchat's: TRANSFORMERS or OWN_LLAMA;
    another engine names itself), the C kernels' instruction set (None: torch ops between the
    GEMMs) and the threads they start with, and the GreedyHead's screens (empty: greedy tokens
    are the argmax of full logits)."""

    device: str
    dtype: str
    forward: str
    kernels: str | None = None
    kernel_threads: int = 1
    greedy_head: tuple[str, ...] = ()

    def label(self) -> str:
        """A stable name for a metric label: the forward, then `+c-kernels` and `+greedy-head` when they run."""
        parts = [self.forward]
        if self.kernels is not None:
            parts.append("c-kernels")
        if self.greedy_head:
            parts.append("greedy-head")
        return "+".join(parts)

    def describe(self) -> str:
        """For the startup log, e.g. `own Llama forward + C kernels (avx512, 1 thread) + greedy
        head (int8, bf16), cpu float32`."""
        text = _FORWARD_NAMES.get(self.forward, f"{self.forward} engine")
        if self.kernels is not None:
            threads = f"{self.kernel_threads} thread{'s' if self.kernel_threads != 1 else ''}"
            text += f" + C kernels ({self.kernels}, {threads})"
        if self.greedy_head:
            text += f" + greedy head ({', '.join(self.greedy_head)})"
        return f"{text}, {self.device} {self.dtype}"


# The prompt's KV from a token on (Prefilled.kv's layout), or None when it cannot be had.
KVSource = Callable[[int], "np.ndarray | None"]
PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class Prefilled:
    """A prompt prefilled: its first output token, its KV and how many of its tokens the
    engine's prefix cache gave rather than computed. The KV is either exported in the wire
    layout (`kv`, core.kv.base: [layers, 2, kv_heads, tokens, head_dim] in the model's dtype)
    for a pdchat connector to carry, or kept by an engine that moves it itself, which says
    how a decode engine reaches it (`transfer_params`: vLLM's kv_transfer_params)."""

    first: Choice
    kv: np.ndarray | None
    cached_tokens: int
    transfer_params: dict | None = None


@dataclass(frozen=True)
class PrefillRequest:
    prompt_token_ids: list[int]
    params: GenerationParams


@dataclass(frozen=True)
class DecodeRequest:
    """One answer to decode. With `first` and `kv_source` it continues from prefill: `kv_source(start)`
    gives the prompt's KV from token `start` on (those before may be in this engine's prefix
    cache), None when it cannot (the engine then computes the prompt from the ids, keeping
    `first` as the answer's first token); `on_kv_released` runs once the engine no longer
    reads what `kv_source` gave. Without them the engine computes the prompt itself.
    `prefetch_kv`: blocking work that makes `kv_source` answer from memory (a pull that waits
    on the network), which the engine runs off its stepping thread before the request is
    queued. `cached_tokens`: what prefill's prefix cache gave (reported in the first delta).
    `owner`: the caller whose share of decode's KV the request counts against (setting
    decode_kv_share); "": the request is its own. `transfer_params`: for an engine that moves
    KV itself, what its prefill engine said (Prefilled.transfer_params), from prefill's
    sealed handle; it then pulls the KV itself, or computes the prompt where it cannot."""

    key: str  # unique per request (GenerationParams.request_id): what cancel() names
    prompt_token_ids: list[int]
    params: GenerationParams
    first: Choice | None = None
    kv_source: KVSource | None = None
    on_kv_released: Callable[[], None] | None = None
    prefetch_kv: Callable[[], object] | None = None
    cached_tokens: int = 0
    owner: str = ""
    transfer_params: dict | None = None


@dataclass(frozen=True)
class DecodeCallbacks:
    """Where a decode request's progress goes; exactly one of `emit` with a finish reason,
    `fail` or `cancelled` ends it."""

    started: Callable[[], None]  # admitted: its KV is being taken in or its prompt computed
    emit: Callable[[Delta], None]  # each delta; the last has a finish_reason
    fail: Callable[[Exception], None]
    cancelled: Callable[[], None]  # cancel(key) took effect


@dataclass(frozen=True)
class EngineState:
    """A decode engine's requests and KV now."""

    running: int  # decoding, or computing their prompt
    waiting: int  # queued for room
    kv_bytes: int  # KV its requests hold


class StateReports:
    """An engine's reports to `on_state` (EngineHooks.on_state): a changed state at most every
    `interval_s` while work goes on (the KV held changes nearly every step at 16 rows; each
    report is several metric updates, each a round trip to the server), and at once when the
    engine turns idle after any work, so the last state is never left unreported.

    NOTE: the idle state is reported after every request taken in since the last report
    (`took_work`), even when it equals the one reported: what `on_state` reads beside it (the
    pool's token counters) moved with the request."""

    def __init__(
        self,
        on_state: Callable[[EngineState], None] | None,
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._on_state, self._interval_s, self._clock = on_state, interval_s, clock
        self._state: EngineState | None = None
        self._reported_at = float("-inf")
        self._taken = False

    def took_work(self) -> None:
        self._taken = True

    def report(self, idle: bool, state: Callable[[], EngineState]) -> None:
        """Report `state()` (made only when it is due) if it is; `idle`: the engine holds no request."""
        if self._on_state is None:
            return
        now = self._clock()
        if not idle and now - self._reported_at < self._interval_s:
            return
        made = state()
        if made != self._state or (idle and self._taken):
            self._state, self._reported_at, self._taken = made, now, False
            self._on_state(made)


@dataclass(frozen=True)
class EngineHooks:
    """What an engine reports while it runs, on its own thread (each must be cheap): a
    decode engine's `on_state` (its running/waiting requests and KV held, throttled),
    `on_load(held, queued)` (the requests it holds and those waiting for room, every pass)
    and `on_emitted()` (a step's deltas all handed out); any engine's `on_dead()`, once,
    when it can serve no more (vLLM's engine core died). Taking turns on the server's cores
    (setting prefill_takes_cores_ms, pdchat's engine): a prefill engine calls
    `pass_began(expected_s)` (the seconds it expects the pass to take; True where a decode
    waits for the pass) and `pass_ended()` around a long prompt pass, a
    decode engine `before_step()` before each step, which returns when the step may run
    (a decode whose scheduler has a CPU of its own, decode_cpus, is given none)."""

    on_state: Callable[[EngineState], None] | None = None
    on_load: Callable[[int, int], None] | None = None
    on_emitted: Callable[[], None] | None = None
    on_dead: Callable[[], None] | None = None
    pass_began: Callable[[float], bool] | None = None
    pass_ended: Callable[[], None] | None = None
    before_step: Callable[[], object] | None = None


class Engine(Protocol):
    """What a stage model calls (see the module docstring)."""

    path: ExecutionPath  # what computes the passes: the startup log and pdchat_engine_info say it
    context_length: int
    vocab_size: int
    kv_capacity_tokens: int  # the tokens of KV its pool holds in all
    kv_pool: BlockPool | None  # the pool whose KV events the server publishes (None: none of pdchat's)

    def start(self, hooks: EngineHooks | None = None) -> None:
        """Start serving requests (its threads or loop), reporting to `hooks`."""

    def prefill(
        self, request: PrefillRequest, done: Callable[[Prefilled], None], fail: Callable[[Exception], None]
    ) -> None:
        """Queue the prompt; `done` or `fail` is called once, on the engine's thread."""

    def decode(self, request: DecodeRequest, callbacks: DecodeCallbacks) -> None:
        """Queue the answer; its callbacks are called on the engine's thread."""

    def cancel(self, key: str) -> None:
        """Stop the request with this key, from any thread, wherever it is (waiting for its
        grammar or KV, queued, running); unknown keys are ignored."""

    def pool_usage(self) -> PoolUsage:
        """The KV pool and prefix cache now."""

    def assembler(
        self, prompt_token_ids: list[int], params: GenerationParams, *, first_output_sent: bool = False
    ) -> ResponseAssembler:
        """A request's client outputs, delta by delta."""

    def first_output(
        self, prompt_token_ids: list[int], params: GenerationParams, first: Choice, cached_tokens: int
    ) -> ClientOutput | None:
        """A streamed answer's first output from prefill's first token, as decode will make it."""

    def close(self) -> None:
        """Stop: requests still queued or running end cancelled or failed."""
