"""Prefill's scheduler: one thread computes every prompt, a chunk at a time.

One prefill instance per server holds one KV pool, so its prefix cache serves every
request the server gets (two instances would each cache half the conversations). A prompt
within one chunk (a prefill engine's chunk is `prefill_pass_tokens`, 2,048 tokens) is
computed whole, in one pass. Each pass goes to the prompt with the fewest passes left, the
oldest among equals (`next_turn`), and takes along, oldest first, the other prompts it can
complete while the pass's tokens stay within `pass_tokens` (`prefill_batch_tokens`, 512, on
an engine that batches prompts; `fill_pass`), computed in the same forward pass: a burst of
short prompts, or of one prefix's short suffixes, is one pass, not one each. A prompt whose
first pass would compute the same first block as one in the pass waits for the next, where
that block is cached. Prompts of one pass each are served oldest first, a
burst of long ones one after another (each one's first token comes after its own passes,
not all near the end), a prompt's last pass goes before another prompt's first, and a short
prompt that arrives while a long one prefills waits for at most one chunk of it. NOTE:
passes, not tokens: by tokens, prompts of one pass each went shortest first, and one a few
tokens longer than those arriving after it waited up to STARVE_PASSES passes. A prompt passed
over STARVE_PASSES passes in a row goes next, so short prompts arriving without end still
leave a long one a pass in every STARVE_PASSES + 1 (and a new prompt waits a pass of each
prompt so starved: with many long ones in progress, the passes go oldest first). Before its
first pass a prompt counts what the pool does not cache of it now (a conversation's next
turn, mostly cached, counts as the short prompt it is).

Admission, as decode's: a prompt starts once its blocks fit beside those the prompts in
progress reserve (`PrefillLimits`); until then it waits, in order, up to `max_wait_s`, then
fails Unavailable naming the limit. A prompt larger than the whole pool fails at once. So a
burst of long prompts waits its turn instead of failing halfway through for want of blocks.

`submit()` from any thread; `done` and `fail` are called on the scheduler thread, once per
job, and should hand server calls to another thread (prefill's outbox).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdchat.core.errors import Unavailable

log = logging.getLogger(__name__)


class Prefilling(Protocol):
    """What the scheduler needs of a prompt in progress (core.generation.generation.PrefillJob)."""

    @property
    def next_pass_tokens(self) -> int:
        """The prompt tokens its next pass computes at most (its cached prefix is found then)."""
        ...

    @property
    def passes_left(self) -> int:
        """The passes it has left (at most: its cached prefix is found at its first pass)."""
        ...

    @property
    def uncached_block(self) -> int | None:
        """Before its first pass, the prefix-cache key of the first block that pass would
        compute (None: none, or after its first pass)."""
        ...

    def step(self) -> Any | None:
        """Its next pass, alone: its result once its prompt is complete, else None."""
        ...

    def abandon(self) -> None: ...


def step_each(jobs: list[Prefilling]) -> list[Any | None]:
    """A pass of several prompts as one pass each (an engine that batches none)."""
    return [job.step() for job in jobs]


@dataclass
class PrefillTask:
    start: Callable[[], Prefilling]  # builds the job (checks the prompt, takes its cached blocks)
    done: Callable[[Any], None]  # its result
    fail: Callable[[Exception], None]
    tokens: int = 0  # the prompt's: what its KV takes of the pool
    queued_at: float = field(default=0.0, init=False)


STARVE_PASSES = 8  # a prompt passed over this many passes in a row goes next


def next_turn(passes_left: list[int], passed_over: list[int]) -> int:
    """Which of the prompts in progress (oldest first; each one's passes left and the passes
    it was passed over in a row) the next pass computes: the oldest passed over
    STARVE_PASSES times, else the one with the fewest passes left, the oldest among equals."""
    starved = [turn for turn, passes in enumerate(passed_over) if passes >= STARVE_PASSES]
    if starved:
        return starved[0]
    return min(range(len(passes_left)), key=passes_left.__getitem__)


def fill_pass(
    chosen: int, passes_left: list[int], tokens: list[int], blocks: list[int | None], budget: int
) -> list[int]:
    """The prompts in progress (oldest first: each one's passes left, its next pass's tokens
    and its uncached_block) a pass computes: `chosen`, then, oldest first, each prompt this
    pass completes (one pass left) while the pass's tokens stay within `budget`, but one
    whose first block is a member's (it would compute that block again)."""
    members, left = [chosen], budget - tokens[chosen]
    taken = {blocks[chosen]} - {None}
    for turn in range(len(passes_left)):
        if turn == chosen or passes_left[turn] != 1 or tokens[turn] > left or blocks[turn] in taken:
            continue
        members.append(turn)
        left -= tokens[turn]
        if blocks[turn] is not None:
            taken.add(blocks[turn])
    return members


@dataclass(eq=False)
class _Turn:
    task: PrefillTask
    job: Prefilling
    passed_over: int = 0


@dataclass(frozen=True)
class PrefillLimits:
    kv_blocks: int = 0  # the pool's blocks the prompts in progress may reserve; 0: no KV check
    block_tokens: int = 16
    max_wait_s: float = 30.0  # waiting for room, before UNAVAILABLE

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens) if self.kv_blocks else 0


class PrefillScheduler:
    """`before_pass(tokens)` and `after_pass()`: called on the scheduler thread around each
    pass, `tokens` the most it computes (the torch threads it takes, PassThreads; the marks
    of a pass that takes the server's cores in turns with decode, EngineHooks).
    `compute(jobs)` computes a pass of those jobs, per job its result, None, or the exception
    that failed it alone, and raises where the pass failed (one each: `step_each`; the engine's batched
    pass: core.generation.generation.PrefillJob.compute_pass); `pass_tokens` bounds the tokens of a pass
    of several (0: one prompt per pass)."""

    def __init__(
        self,
        name: str = "pdchat-prefill",
        before_pass: Callable[[int], object] | None = None,
        limits: PrefillLimits = PrefillLimits(),
        clock: Callable[[], float] = time.monotonic,
        after_pass: Callable[[], object] | None = None,
        compute: Callable[[list[Any]], list[Any | None]] = step_each,
        pass_tokens: int = 0,
    ):
        self._before_pass, self._after_pass = before_pass, after_pass
        self._compute, self._pass_tokens = compute, pass_tokens
        self._limits, self._clock = limits, clock
        self._incoming: queue.SimpleQueue[PrefillTask | None] = queue.SimpleQueue()
        self._waiting: deque[PrefillTask] = deque()  # submitted, not started: no room yet
        self._turns: list[_Turn] = []  # the prompts in progress, oldest first
        self._reserved = 0  # blocks the prompts in progress reserve
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: PrefillTask) -> None:
        self._incoming.put(task)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the chunk in progress; jobs not finished fail."""
        self._incoming.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while self._take_incoming():
            self._admit()
            if not self._turns:
                continue
            members, tokens = self._next()
            try:
                if self._before_pass is not None:
                    self._before_pass(tokens)
                results = self._compute([turn.job for turn in members])
            except Exception as exc:  # noqa: BLE001 - every failure must reach its client
                for turn in members:
                    turn.job.abandon()
                    self._end(turn, turn.task.fail, exc)
                continue
            finally:
                if self._after_pass is not None:
                    self._after_pass()
            for turn, result in zip(members, results, strict=True):
                if isinstance(result, Exception):  # that prompt's alone
                    turn.job.abandon()
                    self._end(turn, turn.task.fail, result)
                elif result is not None:
                    self._end(turn, turn.task.done, result)
        for turn in self._turns:
            turn.job.abandon()
            turn.task.fail(RuntimeError("prefill is shutting down"))
        for task in self._waiting:
            task.fail(RuntimeError("prefill is shutting down"))

    def _take_incoming(self) -> bool:
        """Queue the new tasks, waiting for one while none runs or waits; False once close()
        was called. NOTE: a task waits only while others run (one alone always fits)."""
        block = not self._turns and not self._waiting
        while True:
            try:
                task = self._incoming.get(block=block)
            except queue.Empty:
                return True
            if task is None:
                return False
            block = False
            task.queued_at = self._clock()
            self._waiting.append(task)

    def _admit(self) -> None:
        """Start waiting tasks, oldest first, while their blocks fit; fail those past their wait."""
        limits = self._limits
        while self._waiting:
            task = self._waiting[0]
            wanted = limits.blocks(task.tokens)
            if wanted > limits.kv_blocks:
                self._waiting.popleft()
                task.fail(
                    Unavailable(
                        f"a prompt of {task.tokens} tokens needs {wanted} KV blocks, more than prefill's whole "
                        f"KV pool of {limits.kv_blocks} blocks (prefill_kv_mb)"
                    )
                )
                continue
            if self._reserved + wanted > limits.kv_blocks:
                self._expire()
                return
            self._waiting.popleft()
            try:
                job = task.start()
            except Exception as exc:  # noqa: BLE001
                task.fail(exc)
                continue
            self._reserved += wanted
            self._turns.append(_Turn(task, job))

    def _expire(self) -> None:
        limits, now = self._limits, self._clock()
        while self._waiting and now - self._waiting[0].queued_at >= limits.max_wait_s:
            self._waiting.popleft().fail(
                Unavailable(
                    f"prefill's KV pool stayed full for {limits.max_wait_s:g} s: {self._reserved} of "
                    f"{limits.kv_blocks} blocks reserved by the prompts in progress (prefill_kv_mb); retry later"
                )
            )

    def _next(self) -> tuple[list[_Turn], int]:
        """The prompts in progress the next pass computes (next_turn, fill_pass), and the most
        tokens it computes; the others passed over."""
        turns = self._turns
        passes_left = [t.job.passes_left for t in turns]
        chosen = next_turn(passes_left, [t.passed_over for t in turns])
        if self._pass_tokens:
            tokens = [t.job.next_pass_tokens for t in turns]
            blocks = [
                t.job.uncached_block if passes == 1 or index == chosen else None  # the others join no pass
                for index, (t, passes) in enumerate(zip(turns, passes_left, strict=True))
            ]
            indices = fill_pass(chosen, passes_left, tokens, blocks, self._pass_tokens)
            members, pass_tokens = [turns[i] for i in indices], sum(tokens[i] for i in indices)
        else:
            members, pass_tokens = [turns[chosen]], turns[chosen].job.next_pass_tokens
        for turn in turns:
            turn.passed_over = 0 if turn in members else turn.passed_over + 1
        return members, pass_tokens

    def _end(self, turn: _Turn, report: Callable[[Any], None], outcome: Any) -> None:
        self._turns.remove(turn)
        self._reserved -= self._limits.blocks(turn.task.tokens)
        report(outcome)
