"""vLLM's AsyncLLM behind pdchat's engine seam (core.engine_api.Engine): setting engine=vllm.

The engine runs on an event loop of its own (a daemon thread), as NVIDIA's vllm_backend runs
it. A request is a task there that reads vLLM's token stream (DELTA outputs, no
detokenizing in vLLM) and runs each token through pdchat's AnswerText, so text, stop
strings, stop tokens, the end at a first tool call and max_tokens read as on pdchat's engine;
an answer AnswerText ends before vLLM does is aborted in vLLM. Grammars (response_format,
forced tool calls) go to vLLM's structured outputs as the EBNF pdchat's grammar compiler
builds (core.request.grammar), so both engines constrain alike.

Prefill asks vLLM for one token with `do_remote_decode`: vLLM's NixlConnector keeps the
prompt's blocks and returns the kv_transfer_params a decode engine reads them with
(Prefilled.transfer_params; the stage model signs them into the handoff). Decode gives them
back to vLLM with the same ids; vLLM pulls the KV and generates from there, the first token
again included (the same token under greedy or a seeded draw: pdchat seeds every request).
KV it cannot pull is recomputed (kv_load_failure_policy recompute).

vLLM's engine core runs in a child process (VLLM::EngineCore) even in-process mode; a
watcher process stops it if this process dies without closing the engine (`kill -9`), and
the engine core's death is told to `EngineHooks.on_dead` (the stage model then exits, for
supervision to restart the server).
"""

from __future__ import annotations

import asyncio
import locale
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from pdchat import tensors
from pdchat.core import procfs
from pdchat.core.engine_api import (
    DECODE,
    PREFILL,
    DecodeCallbacks,
    DecodeRequest,
    EngineHooks,
    EngineState,
    ExecutionPath,
    Prefilled,
    PrefillRequest,
    StateReports,
)
from pdchat.core.errors import InvalidRequest, ModelUnavailable, PdchatError, Unavailable
from pdchat.core.generation.answers import Answers, AnswerText
from pdchat.core.generation.paged import PoolUsage
from pdchat.core.generation.sampling import Choice
from pdchat.core.output.responses import Delta
from pdchat.core.request.grammar import grammar_ebnf
from pdchat.core.request.protocol import GenerationParams
from pdchat.core.settings import kv_pool_options
from pdchat.core.vllm.arguments import (
    cpu_kv_cache_gib,
    engine_arguments,
    refuse_unapplied_settings,
    sampling_arguments,
    token_logprobs,
)
from pdchat.models import ModelSettings

log = logging.getLogger(__name__)
VLLM = "vllm"  # ExecutionPath.forward of this engine
ENGINE_CHECK_S = 1.0  # how often the engine core's life is looked at
# AsyncEngineArgs fields that take vLLM config objects, and those objects' classes in vllm.config.
_CONFIG_ARGUMENTS = {
    "kv_transfer_config": "KVTransferConfig",
    "kv_events_config": "KVEventsConfig",
    "structured_outputs_config": "StructuredOutputsConfig",
}
# Stops vLLM's engine core (argv[2:]) once its parent (argv[1]) is gone.
_WATCHER = """
import os, signal, sys, time
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while os.getppid() == parent:
    time.sleep(1)
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def prepare_process(pool_bytes: int, on_cpu: bool) -> None:
    """What this process needs before vLLM is imported: a UTF-8 locale (the python backend's
    stub leaves it ASCII, and torch's inductor then fails to read its templates); the model
    run in the engine core's process, not a worker process of its own (VLLM_ENABLE_V1_MULTIPROCESSING
    unset: as fast on 2 cores, one process fewer); on CPU, the KV cache sized as pdchat's pool unless
    VLLM_CPU_KVCACHE_SPACE says; a port of its own for the NixlConnector's handshake unless
    VLLM_NIXL_SIDE_CHANNEL_PORT says (every engine with the connector listens on one)."""
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib(pool_bytes)))
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(probe.getsockname()[1])


class VllmEngine:
    """vLLM's engine for one stage instance (see the module docstring and core.engine_api)."""

    kv_pool = None  # vLLM publishes its own KV events (setting {role}_kv_events_endpoint)

    def __init__(self, role: str, settings: ModelSettings, parameters: dict[str, str], instance: str):
        if role not in (PREFILL, DECODE):
            raise ValueError(f"an engine serves prefill or decode, not {role!r}")
        self.role, self.name = role, instance
        refuse_unapplied_settings(role, parameters)
        on_cpu = settings.device == "cpu" or (settings.device == "auto" and not _cuda_available())
        prepare_process(kv_pool_options(role, parameters).bytes, on_cpu)
        try:
            from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
        except ImportError as exc:
            raise ModelUnavailable(
                f"engine vllm needs vLLM in this server's python ({sys.prefix}): {exc}; "
                "scripts/bootstrap.sh --vllm builds .venv-vllm (docs/engines.md)"
            ) from None
        self.answers = Answers(settings.path)
        self._arguments = engine_arguments(role, settings, parameters, instance, on_cpu=on_cpu)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"pdchat-vllm-{role}", daemon=True)
        self._thread.start()
        self._tasks: dict[str, asyncio.Task] = {}
        self._hooks = EngineHooks()
        self._reports = StateReports(None)
        self._stats = _Stats()
        self._flush_due = False
        self._death_watch = None
        self._llm = self._run(self._open()).result()
        config = self._llm.vllm_config
        self.context_length = config.model_config.max_model_len
        self.vocab_size = config.model_config.get_vocab_size()
        self.block_tokens = config.cache_config.block_size
        self.total_blocks = config.cache_config.num_gpu_blocks or 0
        self.kv_capacity_tokens = self.total_blocks * self.block_tokens
        model = config.model_config
        self._kv_bytes_per_block = (
            model.get_num_layers(config.parallel_config)
            * 2
            * model.get_num_kv_heads(config.parallel_config)
            * model.get_head_size()
            * model.dtype.itemsize
            * self.block_tokens
        )
        dtype = str(model.dtype).removeprefix("torch.")
        self.path = ExecutionPath(device="cpu" if on_cpu else "cuda", dtype=dtype, forward=VLLM)
        self._watcher = _start_watcher()

    @classmethod
    def for_stage(cls, role: str, settings: ModelSettings, parameters: dict[str, str], instance: str) -> VllmEngine:
        return cls(role, settings, parameters, instance)

    async def _open(self):
        import vllm.config
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        arguments = dict(self._arguments)
        for key, class_name in _CONFIG_ARGUMENTS.items():
            if isinstance(arguments.get(key), dict):
                arguments[key] = getattr(vllm.config, class_name)(**arguments[key])
        try:
            engine_args = AsyncEngineArgs(**arguments)
        except TypeError as exc:
            raise ModelUnavailable(f"vLLM's engine arguments: {exc}") from None
        return AsyncLLM.from_engine_args(engine_args, stat_loggers=[_stat_logger(self._on_stats)])

    def _run(self, coroutine: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def start(self, hooks: EngineHooks | None = None) -> None:
        self._hooks = hooks or EngineHooks()
        self._reports = StateReports(self._hooks.on_state)
        self._death_watch = self._run(self._notice_engine_death())

    async def _notice_engine_death(self) -> None:
        """Tell `on_dead` once vLLM's engine core is gone (its requests fail UNAVAILABLE meanwhile)."""
        while not self._llm.errored:
            await asyncio.sleep(ENGINE_CHECK_S)
        log.error("%s: vLLM's engine core died", self.name)
        if self._hooks.on_dead is not None:
            self._hooks.on_dead()

    # Requests: each a task on the loop, by key.

    def prefill(
        self, request: PrefillRequest, done: Callable[[Prefilled], None], fail: Callable[[Exception], None]
    ) -> None:
        self._submit(request.params.request_id, self._prefill(request, done, fail))

    def decode(self, request: DecodeRequest, callbacks: DecodeCallbacks) -> None:
        self._submit(request.key, self._decode(request, callbacks))

    def cancel(self, key: str) -> None:
        # NOTE: after the decode() that started it: call_soon_threadsafe keeps their order.
        self._loop.call_soon_threadsafe(self._cancel, key)

    def _submit(self, key: str, coroutine: Coroutine) -> None:
        def start() -> None:
            task = self._loop.create_task(coroutine)
            self._tasks[key] = task
            task.add_done_callback(lambda _: self._tasks.pop(key, None) if self._tasks.get(key) is task else None)

        self._loop.call_soon_threadsafe(start)

    def _cancel(self, key: str) -> None:
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()

    async def _prefill(self, request: PrefillRequest, done: Callable, fail: Callable) -> None:
        params = request.params
        try:
            sampling = self._sampling(params, prefill=True)
            final = None
            async for output in self._llm.generate(
                self._prompt(request.prompt_token_ids, params), sampling, params.request_id
            ):
                final = output
        except asyncio.CancelledError:
            fail(Unavailable("prefill was stopped: the server is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - every failure reaches the request as pdchat's error
            fail(_request_error(exc))
            return
        completion = None if final is None else final.outputs[0]
        if completion is None or completion.finish_reason not in ("stop", "length") or not completion.token_ids:
            reason = None if completion is None else completion.finish_reason
            fail(Unavailable(f"vLLM's prefill ended ({reason!r}) with no token"))
            return
        token = completion.token_ids[0]
        first = Choice(token, self._logprobs(completion, 0, token, params))
        done(Prefilled(first, None, final.num_cached_tokens or 0, final.kv_transfer_params))

    async def _decode(self, request: DecodeRequest, callbacks: DecodeCallbacks) -> None:
        params = request.params
        key = request.key
        try:
            sampling = self._sampling(params, transfer_params=request.transfer_params)
            answer = AnswerText(self.answers, request.prompt_token_ids, params)
            prompt = self._prompt(request.prompt_token_ids, params)
        except Exception as exc:  # noqa: BLE001
            callbacks.fail(_request_error(exc))
            return
        callbacks.started()
        self._reports.took_work()
        first = True
        try:
            async for output in self._llm.generate(prompt, sampling, key):
                completion = output.outputs[0]
                # On the first delta (AnswerText.emit): what a prefill's prefix cache gave, else this engine's.
                cached = request.cached_tokens if request.transfer_params else (output.num_cached_tokens or 0)
                deltas = []
                for index, token in enumerate(completion.token_ids):
                    deltas.append(answer.emit(Choice(token, self._logprobs(completion, index, token, params)), cached))
                    if deltas[-1].finish_reason:
                        break
                for delta in _coalesced(deltas, keep_first_apart=first):
                    callbacks.emit(delta)
                first = first and not deltas
                if deltas:
                    self._emitted()
                if deltas and deltas[-1].finish_reason:
                    if not output.finished:
                        await self._llm.abort(key)
                    return
                if output.finished:
                    self._finished(completion.finish_reason, callbacks)
                    return
        except asyncio.CancelledError:  # cancel(): closing vLLM's stream aborted its request
            callbacks.cancelled()
            raise
        except Exception as exc:  # noqa: BLE001
            callbacks.fail(_request_error(exc))

    def _finished(self, reason: str | None, callbacks: DecodeCallbacks) -> None:
        """vLLM ended the answer before AnswerText did."""
        if reason == "abort":
            callbacks.cancelled()
        elif reason in ("stop", "length"):  # a stop token of vLLM's own (its generation config)
            callbacks.emit(Delta("", [], reason))
            self._emitted()
        else:
            callbacks.fail(Unavailable(f"vLLM's engine failed this request (finish reason {reason!r})"))

    def _sampling(self, params: GenerationParams, *, prefill: bool = False, transfer_params: dict | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if self.answers.harmony is not None:
            self.answers.check_harmony(params)
        arguments = sampling_arguments(params, prefill=prefill, transfer_params=transfer_params)
        if params.constraint is not None:
            arguments["structured_outputs"] = StructuredOutputsParams(grammar=grammar_ebnf(params.constraint))
        return SamplingParams(**arguments, output_kind=RequestOutputKind.DELTA)

    @staticmethod
    def _prompt(ids: list[int], params: GenerationParams):
        from vllm.inputs import tokens_input

        return tokens_input(list(ids), cache_salt=params.cache_salt)

    @staticmethod
    def _logprobs(completion, index: int, token: int, params: GenerationParams):
        if not params.logprobs or not completion.logprobs:
            return None
        return token_logprobs(token, completion.logprobs[index], params.top_logprobs)

    def _emitted(self) -> None:
        """Once per loop pass: a step's deltas are all handed out (EngineHooks.on_emitted)."""
        if self._flush_due or self._hooks.on_emitted is None:
            return
        self._flush_due = True

        def flush() -> None:
            self._flush_due = False
            self._hooks.on_emitted()

        self._loop.call_soon(flush)

    # vLLM's scheduler stats, on the loop: the engine's state and its KV pool.

    def _on_stats(self, stats) -> None:
        self._stats.update(stats)
        running, waiting = stats.num_running_reqs, stats.num_waiting_reqs
        if self._hooks.on_load is not None:
            self._hooks.on_load(running, waiting)
        used_blocks = self._stats.usage(self.total_blocks, self.block_tokens).used_blocks
        self._reports.report(
            running + waiting == 0, lambda: EngineState(running, waiting, used_blocks * self._kv_bytes_per_block)
        )

    def pool_usage(self) -> PoolUsage:
        return self._stats.usage(self.total_blocks, self.block_tokens)

    def assembler(self, prompt_token_ids, params, *, first_output_sent: bool = False):
        """InvalidRequest for `first_output_sent`: no prefill on this engine gives a first output
        (`first_output`), so decode's first delta is the answer's first token and is never skipped."""
        if first_output_sent:
            raise InvalidRequest(
                f"'{tensors.FIRST_OUTPUT_SENT}': engine vllm sends no first output from prefill (decode makes "
                "the answer's first token again); leave it unset"
            )
        return self.answers.assembler(prompt_token_ids, params)

    def first_output(self, prompt_token_ids, params, first, cached_tokens):
        """None: decode generates the first token again (module docstring), so it shows it."""
        return None

    def close(self) -> None:
        if self._death_watch is not None:
            self._death_watch.cancel()  # the engine core stopping now is no death

        async def stop() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.sleep(0)
            self._llm.shutdown()

        try:
            self._run(stop()).result(timeout=30)
        except Exception:  # noqa: BLE001 - closing: the watcher stops the engine core anyway
            log.exception("%s: stopping vLLM's engine", self.name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._watcher is not None:
            self._watcher.kill()


def _coalesced(deltas: list[Delta], keep_first_apart: bool) -> list[Delta]:
    """The tokens of one vLLM output (several where this loop fell behind vLLM, which then
    merges them) as one delta, as vLLM's own server streams them; the answer's first token
    alone (`keep_first_apart`), since a client that has it from prefill skips that delta."""
    if keep_first_apart and deltas:
        return deltas[:1] + _coalesced(deltas[1:], keep_first_apart=False)
    if len(deltas) < 2:
        return deltas
    return [
        Delta(
            "".join(delta.text for delta in deltas),
            [token for delta in deltas for token in delta.token_ids],
            deltas[-1].finish_reason,
            [entry for delta in deltas for entry in delta.logprobs],
            deltas[0].cached_tokens,
        )
    ]


class _Stats:
    """vLLM's scheduler stats, added up: its KV cache's use, its prefix cache's hits and the
    prompt tokens its KV connector loaded (a prefill server's KV), which it did not compute."""

    def __init__(self):
        self.kv_usage = 0.0
        self.queried = self.hits = self.loaded = 0

    def update(self, stats) -> None:
        self.kv_usage = stats.kv_cache_usage
        prefix = stats.prefix_cache_stats
        self.queried += prefix.queries
        self.hits += prefix.hits
        if stats.connector_prefix_cache_stats is not None:
            self.loaded += stats.connector_prefix_cache_stats.hits

    def usage(self, total_blocks: int, block_tokens: int) -> PoolUsage:
        return PoolUsage(
            total_blocks=total_blocks,
            used_blocks=round(self.kv_usage * total_blocks),
            cached_blocks=0,
            block_tokens=block_tokens,
            queried_tokens=self.queried,
            hit_tokens=self.hits,
            computed_prompt_tokens=max(0, self.queried - self.hits - self.loaded),
        )


def _stat_logger(on_stats: Callable[[Any], None]):
    """A vLLM stat-logger factory that hands each scheduler stats record to `on_stats`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PdchatStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                on_stats(scheduler_stats)

        def log_engine_initialized(self):
            pass

    return PdchatStatLogger


def _request_error(exc: BaseException) -> PdchatError:
    """pdchat's error for what vLLM raised: its validation errors (the request's fault) as
    INVALID_ARG with their message, a dead engine as UNAVAILABLE, the rest INTERNAL with no
    vLLM traceback (it goes to the log)."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, PdchatError):
        return exc
    for error in (exc, exc.__cause__):
        if isinstance(error, (VLLMClientError, ValueError)):
            return InvalidRequest(f"vLLM refused the request: {error}")
        if isinstance(error, EngineDeadError):
            return Unavailable("vLLM's engine died; this server must be restarted")
    log.error("vLLM failed a request", exc_info=exc)
    return PdchatError(f"vLLM's engine failed the request ({type(exc).__name__}); the server log has the details")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _start_watcher() -> subprocess.Popen | None:
    """A process that stops this process's children (vLLM's engine core) once this process is
    gone without stopping them. NOTE: not multiprocessing's resource tracker: it unlinks what
    the engine core left in /dev/shm once they are both gone."""
    me = os.getpid()
    children = [
        pid
        for pid in procfs.pids()
        if procfs.parent_of(pid) == me and "resource_tracker" not in " ".join(procfs.command_words(pid))
    ]
    if not children:
        return None
    return subprocess.Popen([sys.executable, "-c", _WATCHER, str(me), *map(str, children)], stdin=subprocess.DEVNULL)
