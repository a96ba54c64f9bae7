"""pdchat's own engine behind the seam (core.engine_api.Engine): a TextModel and its scheduler.

A prefill engine runs one PrefillScheduler (each pass to the prompt with the fewest passes
left, oldest first among equals; a pass takes more torch threads while the process's cores
sit idle); a decode engine runs one DecodeScheduler
over a DecodeBatch (continuous batching; with `decode_cpus`, its thread on cores of its own).
A request waits for its output grammar to compile (the grammar worker) before it is queued,
so no compile runs on the scheduler's thread; a grammar that does not compile fails it. A
decode request's KV prefetch (a pull that waits on the network: NIXL) then runs on a pull
thread, never the scheduler's, so the batch's rows keep stepping meanwhile. A request
cancelled before it is queued ends cancelled when it would have been.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pdchat.core.engine_api import (
    DECODE,
    PREFILL,
    DecodeCallbacks,
    DecodeRequest,
    EngineHooks,
    Prefilled,
    PrefillRequest,
)
from pdchat.core.generation.engine import DecodeBatch
from pdchat.core.generation.generation import PrefillJob, TextModel
from pdchat.core.generation.pass_threads import PassThreads
from pdchat.core.generation.prefill_scheduler import PrefillLimits, PrefillScheduler, PrefillTask
from pdchat.core.generation.scheduler import DecodeJob, DecodeScheduler, Limits
from pdchat.core.placement import CpuPlacement
from pdchat.core.settings import batching_options, prefill_threads_when_idle
from pdchat.models import ModelSettings

log = logging.getLogger(__name__)
KV_PULL_THREADS = 2  # KV prefetches that wait on the network (NIXL) at once, off the scheduler thread


class PdchatEngine:
    """pdchat's engine for one stage instance (see the module docstring and core.engine_api)."""

    def __init__(self, role: str, model: TextModel, parameters: dict[str, str], cpus: CpuPlacement | None, name: str):
        if role not in (PREFILL, DECODE):
            raise ValueError(f"an engine serves prefill or decode, not {role!r}")
        self.role, self.model, self.name = role, model, name
        self._parameters, self._cpus = parameters, cpus
        engine = model.engine
        self.path = engine.path
        self.context_length, self.vocab_size = engine.context_length, engine.vocab_size
        self.kv_pool = engine.pool
        self.kv_capacity_tokens = engine.pool.total_blocks * engine.pool.block_tokens
        self._options = batching_options(parameters)
        self._prefill: PrefillScheduler | None = None
        self._decode: DecodeScheduler | None = None
        self._pulls: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._not_queued: set[str] = set()  # decode requests waiting for their grammar or KV
        self._cancelled: set[str] = set()  # of those, the ones cancel() named

    @classmethod
    def for_stage(
        cls, role: str, settings: ModelSettings, parameters: dict[str, str], name: str, cpus: CpuPlacement | None
    ) -> PdchatEngine:
        """The stage's model loaded (TextModel.for_stage); `cpus`: decode's scheduler thread's
        placement (setting decode_cpus), None: unbound."""
        return cls(role, TextModel.for_stage(role, settings, parameters), parameters, cpus, name)

    def start(self, hooks: EngineHooks | None = None) -> None:
        hooks = hooks or EngineHooks()
        engine = self.model.engine
        most = prefill_threads_when_idle(self._parameters)
        if self.role == PREFILL:
            # A pass takes more torch threads while this process's other cores sit idle, or
            # `most` whenever decode waits for it (EngineHooks.pass_began: prefill_takes_cores_ms).
            limits = PrefillLimits(engine.pool.total_blocks, engine.pool.block_tokens, self._options.queue_timeout_s)
            threads = PassThreads.for_engine(engine, most)
            turns = _PassTurns(threads, hooks, self._options.prefill_takes_cores_ms)
            self._prefill = PrefillScheduler(
                before_pass=turns.before,
                limits=limits,
                after_pass=turns.after,
                compute=PrefillJob.compute_pass,
                pass_tokens=self._options.prefill_batch_tokens if engine.batches_prompts else 0,
            )
            return
        limits = Limits(
            max_running=self._options.max_running,
            kv_blocks=engine.pool.total_blocks,
            block_tokens=engine.pool.block_tokens,
            max_wait_s=self._options.queue_timeout_s,
            owner_share=self._options.kv_share,
        )
        # chat gives decode a prompt to prefill only while the server is idle (local_prefill_when_idle),
        # so its chunks take every core while no row runs (none when decode_cpus binds the scheduler).
        self._pulls = ThreadPoolExecutor(KV_PULL_THREADS, thread_name_prefix="pdchat-kv-pull")
        lone_prompt_threads = None
        if self._cpus is None:
            lone_prompt_threads = PassThreads.for_engine(engine, most, watch_cores=False)
        self._decode = DecodeScheduler(
            DecodeBatch(engine),
            limits,
            on_state=hooks.on_state,
            on_load=hooks.on_load,
            on_emitted=hooks.on_emitted,
            cpus=self._cpus and self._cpus.decode,
            pass_threads=lone_prompt_threads,
            before_step=hooks.before_step,
        )
        if self._cpus is not None:
            log.info("%s: %s (setting decode_cpus)", self.name, self._cpus.describe())

    def prefill(
        self, request: PrefillRequest, done: Callable[[Prefilled], None], fail: Callable[[Exception], None]
    ) -> None:
        task = PrefillTask(
            start=functools.partial(
                PrefillJob, self.model, request.prompt_token_ids, request.params, self._options.prefill_pass_tokens
            ),
            done=done,
            fail=fail,
            tokens=len(request.prompt_token_ids),
        )
        submit = self._running(self._prefill).submit
        self._when_compiled(request.params.constraint, fail, functools.partial(submit, task))

    def decode(self, request: DecodeRequest, callbacks: DecodeCallbacks) -> None:
        params = request.params

        def start():  # on the scheduler thread, on admission
            callbacks.started()
            return self.model.generation(
                request.prompt_token_ids,
                params,
                first=request.first,
                kv_source=request.kv_source,
                on_kv_released=request.on_kv_released,
                prefill_chunk=self._options.prefill_chunk,
                cached_tokens=request.cached_tokens,
            )

        job = DecodeJob(
            key=request.key,
            start=start,
            emit=callbacks.emit,
            fail=callbacks.fail,
            on_cancel=callbacks.cancelled,
            tokens=len(request.prompt_token_ids) + params.max_tokens,
            owner=request.owner,
        )
        self._running(self._decode)
        with self._lock:
            self._not_queued.add(job.key)

        def failed(error: Exception) -> None:
            self._forget(job.key)
            job.fail(error)

        def compiled() -> None:
            if request.prefetch_kv is None:
                self._queue(job)
            else:  # NOTE: never on the scheduler's thread: it would hold every row's step
                self._pulls.submit(request.prefetch_kv).add_done_callback(lambda _: self._queue(job))

        self._when_compiled(params.constraint, failed, compiled)

    def cancel(self, key: str) -> None:
        with self._lock:
            if key in self._not_queued:
                self._cancelled.add(key)
                return
        if self._decode is not None:
            self._decode.cancel(key)

    def _queue(self, job: DecodeJob) -> None:
        """Queue a decode request whose grammar and KV are ready, or end it cancelled."""
        with self._lock:  # a cancel() from here on reaches the scheduler after the job
            cancelled = self._forget_locked(job.key)
            if not cancelled:
                self._decode.submit(job)
        if cancelled:
            job.on_cancel()

    def _forget(self, key: str) -> bool:
        """`key` is no longer waiting; whether cancel() named it meanwhile."""
        with self._lock:
            return self._forget_locked(key)

    def _forget_locked(self, key: str) -> bool:
        self._not_queued.discard(key)
        cancelled = key in self._cancelled
        self._cancelled.discard(key)
        return cancelled

    def pool_usage(self):
        return self.model.engine.pool.usage()

    def assembler(self, prompt_token_ids, params, *, first_output_sent: bool = False):
        return self.model.assembler(prompt_token_ids, params, first_output_sent=first_output_sent)

    def first_output(self, prompt_token_ids, params, first, cached_tokens):
        return self.model.first_output(prompt_token_ids, params, first, cached_tokens)

    def close(self) -> None:
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
        for scheduler in (self._prefill, self._decode):
            if scheduler is not None:
                scheduler.close()
        self.model.close()

    def _when_compiled(
        self, grammar: dict | None, fail: Callable[[Exception], None], queue: Callable[[], None]
    ) -> None:
        """`queue()` once the request's output grammar is compiled (at once without one), or
        `fail` with its error."""

        def compiled(future: Future) -> None:
            error = future.exception()
            if error is None:
                queue()
            else:
                fail(error)

        self.model.constraints.prepare(grammar).add_done_callback(compiled)

    def _running(self, scheduler):
        if scheduler is None:
            raise RuntimeError(f"this {self.role} engine was not started, or serves the other stage")
        return scheduler


class _PassTurns:
    """Prefill's side of prefill_takes_cores_ms: a pass expected to take at least `from_ms` on
    every core is marked for decode to wait for (EngineHooks.pass_began, pass_ended) and,
    where a decode does, takes every thread (PassThreads.take_most); any other pass takes
    the threads PassThreads decides.

    The expectation is the pass's tokens at the core-seconds per token the passes before it
    took (a moving average, so it holds for any model and host). NOTE: until a pass was
    measured none is expected long, and a pass's tokens are an upper bound (its cached
    prefix is found during it)."""

    def __init__(
        self,
        threads: PassThreads,
        hooks: EngineHooks,
        from_ms: int,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._threads, self._hooks, self._clock = threads, hooks, clock
        self._from_s = from_ms / 1000 if hooks.pass_began is not None else 0.0
        self._core_s_per_token: float | None = None
        self._pass: tuple[float, int, int] | None = None  # started at, tokens, threads
        self._marked = False

    def before(self, tokens: int) -> None:
        expected_s = self._expected_s(tokens)
        self._marked = expected_s >= self._from_s > 0.0 and bool(self._hooks.pass_began(expected_s))
        threads = self._threads.take_most() if self._marked else self._threads.before_pass()
        self._pass = (self._clock(), tokens, threads)

    def after(self) -> None:
        if self._pass is not None:
            started, tokens, threads = self._pass
            measured = (self._clock() - started) * threads / max(tokens, 1)
            average = self._core_s_per_token
            self._core_s_per_token = measured if average is None else 0.8 * average + 0.2 * measured
            self._pass = None
        if self._marked:
            self._threads.after_most()
            if self._hooks.pass_ended is not None:
                self._hooks.pass_ended()

    def _expected_s(self, tokens: int) -> float:
        """The pass's expected seconds on every core; 0.0 before a pass was measured."""
        if self._core_s_per_token is None:
            return 0.0
        return tokens * self._core_s_per_token / self._threads.most
