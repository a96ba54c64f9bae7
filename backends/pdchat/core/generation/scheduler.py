"""Continuous batching: every running request advances in one forward pass per step.

One thread owns the model. Each turn of its loop it
1. takes new requests into a queue, and drops cancelled ones wherever they are;
2. admits queued requests in order while the limits allow (running sequences, reserved KV,
   and each caller's share of both: a request past its owner's share waits for that owner's
   own requests to end while the others pass it); a request that waits longer than
   `max_wait_s` for room gets UNAVAILABLE naming the limit;
3. computes one chunk of one local prefill (a request decode prefills itself), so a long
   prompt shares the thread with the others' steps instead of freezing them (with
   `pass_threads`, a chunk while no row runs takes the cores that sit idle too);
4. emits each running request's pending token (requests that finish leave the batch
   at once, freeing their KV), then runs one forward pass for all the others.

Requests join between steps, after their KV import or local prefill. Cancellation
(`cancel(key)`, from any thread: whoever watches the client calls it) takes effect at the
next turn, within one step. The callbacks of a job run on this thread; one that talks to
a server should hand that work to another thread (decode's outbox), so the forward pass
does not wait on it.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdchat.core.engine_api import EngineState, StateReports
from pdchat.core.errors import Unavailable
from pdchat.core.generation.pass_threads import PassThreads
from pdchat.core.output.responses import Delta
from pdchat.core.placement import bind_thread

log = logging.getLogger(__name__)


class Decoding(Protocol):
    """What the scheduler needs of a request's decode state (core.generation.Generation)."""

    finished: bool
    cache: Any

    @property
    def prefilling(self) -> bool: ...

    @property
    def last_token_id(self) -> int: ...

    @property
    def greedy(self) -> bool: ...

    def prefill_step(self) -> bool: ...

    def emit(self) -> Delta: ...

    def accept(self, logits: Any, argmax: int | None = None) -> None: ...

    def drop(self) -> None: ...


class Batch(Protocol):
    """The running requests' KV, stepped together (core.engine.DecodeBatch)."""

    def __len__(self) -> int: ...

    def join(self, cache: Any) -> int: ...

    def leave(self, rows: list[int]) -> None: ...

    def step_rows(self, token_ids: list[int], greedy: list[bool]) -> tuple[Sequence[Any], Sequence[int | None]]:
        """Each row's logits (None where its greedy token was had without them) and greedy token."""
        ...

    def kv_bytes(self) -> int: ...


@dataclass
class DecodeJob:
    """A request to decode, with the callbacks that reach its client."""

    key: str  # unique per request (GenerationParams.request_id): what cancel() names
    start: Callable[[], Decoding]  # builds the decode state (KV import, or a local prefill to run)
    emit: Callable[[Delta], None]  # called per token; the last delta has a finish_reason
    fail: Callable[[Exception], None]  # the request ends with this error
    on_cancel: Callable[[], None]  # cancel(key) was called: close the stream; its state is dropped
    tokens: int = 0  # prompt + max_tokens: the KV it may come to hold, reserved on admission
    owner: str = ""  # the caller its reservation counts against (Limits.owner_share); "": its key


@dataclass(frozen=True)
class Limits:
    max_running: int = 32  # sequences decoding or prefilling at once
    kv_blocks: int = 0  # KV blocks admitted requests may reserve (the pool's); 0: no KV check
    block_tokens: int = 16  # tokens a block holds
    max_wait_s: float = 30.0  # in the queue, before UNAVAILABLE
    owner_share: float = 1.0  # the part of kv_blocks, and of max_running, one owner's requests may hold together

    def blocks(self, tokens: int) -> int:
        """Blocks a request of `tokens` (prompt + max_tokens) reserves."""
        return -(-tokens // self.block_tokens) if self.kv_blocks else 0

    @property
    def owner_blocks(self) -> int:
        """The most blocks one owner's requests reserve together, but for its first request."""
        return int(self.owner_share * self.kv_blocks)

    @property
    def owner_running(self) -> int:
        """The most sequences one owner's requests hold in the batch together (at least one)."""
        return max(1, math.ceil(self.owner_share * self.max_running))


@dataclass
class _Entry:
    job: DecodeJob
    queued_at: float
    decoding: Decoding | None = None


class DecodeScheduler:
    def __init__(
        self,
        batch: Batch,
        limits: Limits = Limits(),
        *,
        name: str = "pdchat-decode",
        on_state: Callable[[EngineState], None] | None = None,
        state_interval_s: float = 0.1,
        on_load: Callable[[int, int], None] | None = None,
        on_emitted: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpus: frozenset[int] | None = None,
        pass_threads: PassThreads | None = None,
        before_step: Callable[[], object] | None = None,
    ):
        """`cpus`: the CPUs the scheduler's thread (and the torch threads it starts) runs on
        (pdchat.core.placement); None: wherever it was started. `on_load(held, queued)`: called
        on the scheduler's thread with the sequences it holds (queued, prefilling, running)
        and those the last admission left queued for room (the limits), at the start and end
        of each pass, unthrottled: it must be cheap
        (pdchat.ensemble.decode_load.LoadSlot.set). `on_emitted()`: called on the scheduler's
        thread once a step's outputs were handed to their jobs (`emit`), before its forward pass.
        `pass_threads`: a local prefill's chunk takes the torch threads it says while no row
        runs (idle cores join it: a lone prompt's first token comes sooner); every step, and
        a chunk beside running rows, takes its `base`. `before_step()`: called before each
        step's forward pass; the step runs once it returns (EngineHooks.before_step)."""
        self._batch = batch
        self._cpus = cpus
        self._pass_threads = pass_threads
        self._before_step = before_step
        self._limits = limits
        self._reports = StateReports(on_state, state_interval_s, clock)
        self._on_load = on_load
        self._on_emitted = on_emitted
        self._clock = clock
        self._incoming: queue.SimpleQueue[DecodeJob | None] = queue.SimpleQueue()
        self._cancel_requests: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._unmatched: set[str] = set()  # cancel keys of the last turn that matched no job
        self._waiting: list[_Entry] = []
        self._prefilling: list[_Entry] = []
        self._running: list[_Entry] = []  # in the batch's row order
        self._queued_for_room = 0  # jobs the last admission left waiting (at the limits)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: DecodeJob) -> None:
        self._incoming.put(job)

    def cancel(self, key: str) -> None:
        """Stop the job with this key (from any thread), at the next turn; unknown keys
        (a job already ended) are ignored."""
        self._cancel_requests.put(key)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after cancelling whatever is still queued or running."""
        self._incoming.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._cpus is not None:
            bind_thread(self._cpus)
        while self._take_incoming(block=self._held() == 0):
            self._publish_load()
            self._drop_cancelled()
            self._admit()
            self._prefill_chunk()
            self._step()
            self._publish_load()
            self._report()
        ending = self._waiting + self._prefilling + self._running
        for entry in self._prefilling:
            entry.decoding.drop()
        self._leave(list(range(len(self._running))))
        for entry in ending:
            entry.job.on_cancel()

    def _take_incoming(self, *, block: bool) -> bool:
        """Queue new jobs; False once close() was called."""
        while True:
            try:
                job = self._incoming.get(block=block, timeout=self._limits.max_wait_s if block else None)
            except queue.Empty:
                return True
            if job is None:
                return False
            block = False
            self._waiting.append(_Entry(job, self._clock()))
            self._reports.took_work()

    def _drop_cancelled(self) -> None:
        """Cancel the jobs whose keys came. NOTE: a key that matches no job is tried once more,
        at the next turn: a job submitted just before its cancel may be taken only then."""
        carried, fresh = self._unmatched, set()
        while True:
            try:
                fresh.add(self._cancel_requests.get_nowait())
            except queue.Empty:
                break
        keys = carried | fresh
        self._unmatched = set()
        if not keys:
            return
        matched: set[str] = set()

        def cancelled(entry: _Entry) -> bool:
            if entry.job.key in keys:
                entry.job.on_cancel()
                matched.add(entry.job.key)
                return True
            return False

        self._waiting = [e for e in self._waiting if not cancelled(e)]
        for entry in self._prefilling:
            if entry.job.key in keys:
                entry.decoding.drop()
        self._prefilling = [e for e in self._prefilling if not cancelled(e)]
        self._leave([row for row, entry in enumerate(self._running) if cancelled(entry)])
        self._unmatched = fresh - matched

    def _admit(self) -> None:
        self._admit_while_room()
        self._queued_for_room = len(self._waiting)

    def _admit_while_room(self) -> None:
        """Start waiting requests in order while there is room. A request whose owner's share
        is full waits for the owner's own requests to end and is passed; one that does not fit
        the pool or the batch is passed by none (FIFO), so a large request is not starved."""
        if not self._waiting:  # NOTE: every turn comes here: a turn with none waiting costs nothing
            return
        limits = self._limits
        held = self._held_by_owner()
        reserved = sum(blocks for blocks, _ in held.values())
        busy = len(self._prefilling) + len(self._running)
        index = 0
        while index < len(self._waiting):
            entry = self._waiting[index]
            wanted, owner = limits.blocks(entry.job.tokens), _owner(entry.job)
            if wanted > limits.kv_blocks:
                self._waiting.pop(index)
                entry.job.fail(
                    Unavailable(
                        f"this request may need {wanted} KV blocks (prompt + max_tokens = {entry.job.tokens} "
                        f"tokens), more than decode's whole KV pool of {limits.kv_blocks} blocks (decode_kv_mb)"
                    )
                )
                continue
            if self._past_share(held.get(owner), wanted):
                index += 1  # waits for its owner's own requests
                continue
            if busy >= limits.max_running or reserved + wanted > limits.kv_blocks:
                break
            self._waiting.pop(index)
            try:
                entry.decoding = entry.job.start()
            except Exception as exc:  # noqa: BLE001 - every failure must reach its client
                entry.job.fail(exc)
                continue
            blocks, sequences = held.get(owner, (0, 0))
            held[owner] = (blocks + wanted, sequences + 1)
            reserved, busy = reserved + wanted, busy + 1
            if entry.decoding.prefilling:
                self._prefilling.append(entry)
            else:
                self._join(entry)
        if self._waiting:
            self._expire_waiting(busy, reserved, held)

    def _past_share(self, holds: tuple[int, int] | None, wanted: int) -> bool:
        """Whether an owner holding `holds` (blocks, sequences) would pass its share of the KV
        or of the batch's sequences with a request of `wanted` blocks. NOTE: an owner holding
        nothing never is: a lone request larger than the share runs when the pool has room."""
        if not holds or not holds[1]:
            return False
        limits = self._limits
        return holds[0] + wanted > limits.owner_blocks or holds[1] + 1 > limits.owner_running

    def _held_by_owner(self) -> dict[str, tuple[int, int]]:
        """The KV blocks and sequences each owner's admitted requests hold."""
        held: dict[str, tuple[int, int]] = {}
        for entry in self._prefilling + self._running:
            owner = _owner(entry.job)
            blocks, sequences = held.get(owner, (0, 0))
            held[owner] = (blocks + self._limits.blocks(entry.job.tokens), sequences + 1)
        return held

    def _expire_waiting(self, busy: int, reserved: int, held: dict[str, tuple[int, int]]) -> None:
        """Fail the requests that waited past max_wait_s for room. NOTE: not one waiting for its
        owner's own requests (past its share): those end, or their client cancels them."""
        limits, now = self._limits, self._clock()
        expired = [
            e
            for e in self._waiting
            if now - e.queued_at > limits.max_wait_s
            and not self._past_share(held.get(_owner(e.job)), limits.blocks(e.job.tokens))
        ]
        for entry in expired:
            entry.job.fail(
                Unavailable(
                    f"decode stayed at its limits for {limits.max_wait_s:g} s: {busy} of "
                    f"max_running={limits.max_running} sequences, {reserved} of {limits.kv_blocks} KV blocks "
                    "reserved (decode_kv_mb); retry later"
                )
            )
        self._waiting = [e for e in self._waiting if e not in expired]

    def _prefill_chunk(self) -> None:
        if not self._prefilling:
            return
        entry = self._prefilling[0]
        if self._pass_threads is not None and self._running:
            self._pass_threads.at_base()  # rows wait on this chunk: it keeps the step's threads
        elif self._pass_threads is not None:
            self._pass_threads.before_pass()
        try:
            done = entry.decoding.prefill_step()
        except Exception as exc:  # noqa: BLE001
            self._prefilling.pop(0)
            entry.decoding.drop()
            entry.job.fail(exc)
            return
        if done:
            self._prefilling.pop(0)
            self._join(entry)

    def _join(self, entry: _Entry) -> None:
        try:
            self._batch.join(entry.decoding.cache)
        except Exception as exc:  # noqa: BLE001
            entry.job.fail(exc)
            entry.decoding.drop()
            return
        entry.decoding.cache = None  # the batch holds it now
        self._running.append(entry)

    def _step(self) -> None:
        ended = []
        for row, entry in enumerate(self._running):
            try:
                delta = entry.decoding.emit()
            except Exception as exc:  # noqa: BLE001
                log.exception("decode step failed")
                entry.job.fail(exc)
                ended.append(row)
                continue
            try:
                entry.job.emit(delta)
            except Exception as exc:  # noqa: BLE001 - one request's failure to send ends it, not the scheduler
                log.exception("sending a response failed")
                entry.job.fail(exc)
                ended.append(row)
                continue
            if entry.decoding.finished:
                ended.append(row)
        if self._on_emitted is not None and self._running:
            self._on_emitted()
        self._leave(ended)
        if not self._running:
            return
        if self._pass_threads is not None:
            self._pass_threads.at_base()
        if self._before_step is not None:
            self._before_step()  # a prefill pass on the server's cores first (EngineHooks.before_step)
        try:
            # The greedy rows' tokens come with the step, decided for the batch at once.
            logits, argmax = self._batch.step_rows(
                [e.decoding.last_token_id for e in self._running], [e.decoding.greedy for e in self._running]
            )
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: each client hears it
            log.exception("batched decode step failed")
            for entry in self._running:
                entry.job.fail(exc)
            self._leave(list(range(len(self._running))))
            return
        failed = []
        for row, (entry, row_logits, token) in enumerate(zip(self._running, logits, argmax, strict=True)):
            try:
                entry.decoding.accept(row_logits, token)
            except Exception as exc:  # noqa: BLE001
                entry.job.fail(exc)
                failed.append(row)
        self._leave(failed)

    def _leave(self, rows: list[int]) -> None:
        if rows:
            self._batch.leave(rows)
            leaving = set(rows)
            self._running = [e for row, e in enumerate(self._running) if row not in leaving]

    def _held(self) -> int:
        """Sequences this scheduler holds: queued, prefilling or running."""
        return len(self._waiting) + len(self._prefilling) + len(self._running)

    def _publish_load(self) -> None:
        if self._on_load is not None:
            self._on_load(self._held(), self._queued_for_room)

    def _report(self) -> None:
        """Tell `on_state` of the state (StateReports: spaced while work goes on)."""
        self._reports.report(
            self._held() == 0,
            lambda: EngineState(len(self._running) + len(self._prefilling), len(self._waiting), self._batch.kv_bytes()),
        )


def _owner(job: DecodeJob) -> str:
    return job.owner or job.key
