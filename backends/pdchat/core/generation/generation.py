"""Prefill and decode of one model: first token + KV, then one token per step.

`TextModel` bundles what both stages need (engine, tokenizer, EOS ids, grammar
compiler), so the prefill and decode models and the in-process pipeline share one
implementation of sampling, constraints and stop conditions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdchat.core.engine_api import Prefilled
from pdchat.core.generation.answers import Answers, AnswerText
from pdchat.core.generation.constraints import ConstraintCompiler
from pdchat.core.generation.engine import CausalLM, KVSource, PromptPrefill
from pdchat.core.generation.sampling import Choice, LogitsShaper, TokenChooser, token_logprobs
from pdchat.core.output.responses import Delta
from pdchat.core.request.protocol import GenerationParams
from pdchat.core.settings import DEFAULT_KV_POOL, CompileOptions, KVPoolOptions, compile_options, kv_pool_options
from pdchat.models import ModelSettings

if TYPE_CHECKING:
    import torch

    from pdchat.models import ModelSettings


class PrefillJob:
    """Prefill's whole job, chunk by chunk: the first output token (with its logprobs, if
    asked) and the prompt's KV for decode. The prompt's full blocks stay in the pool's
    prefix cache. Abandoned before its end, it must be `abandon()`ed (its blocks go back)."""

    def __init__(self, model: TextModel, prompt_token_ids: list[int], params: GenerationParams, chunk: int):
        self._chooser = model.chooser(prompt_token_ids, params)
        self._engine = model.engine
        self._prompt = PromptPrefill(model.engine, prompt_token_ids, params.cache_salt, chunk)

    @property
    def next_pass_tokens(self) -> int:
        """The prompt tokens its next chunk computes at most (before the first, after the
        prefix the pool caches now)."""
        return min(self._prompt.remaining, self._prompt.chunk)

    @property
    def passes_left(self) -> int:
        """The chunks left to compute (before the first, after the prefix the pool caches now)."""
        return -(-self._prompt.remaining // self._prompt.chunk)

    @property
    def uncached_block(self) -> int | None:
        """PromptPrefill.uncached_block: a prompt sharing it waits for the pass that computes it."""
        return self._prompt.uncached_block

    def step(self) -> Prefilled | None:
        """One chunk, alone; the result once the prompt is complete (the sequence then
        released). A failure releases the sequence."""
        try:
            outcome = PrefillJob.compute_pass([self])[0]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        except BaseException:
            self.abandon()
            raise

    @staticmethod
    def compute_pass(jobs: list[PrefillJob]) -> list[Prefilled | Exception | None]:
        """One pass of prefill: each job's next chunk, in one forward pass where the engine
        batches prompts (CausalLM.prefill_chunks); per job its result once its prompt is
        complete, the exception that failed that job alone (its first token's choice, its KV's
        export), else None. NOTE: a failure of the pass itself raises: the caller abandons
        every job of it."""
        chunks = [job._prompt.next_chunk(job._chooser.greedy) for job in jobs]
        outcomes: list[Prefilled | Exception | None] = []
        for job, pair in zip(jobs, jobs[0]._engine.prefill_chunks(chunks), strict=True):
            try:
                outcomes.append(job._finish(pair))
            except Exception as exc:  # noqa: BLE001 - this job's failure, not its pass's
                outcomes.append(exc)
        return outcomes

    def abandon(self) -> None:
        self._prompt.release()

    def _finish(self, computed: tuple[torch.Tensor | None, int | None]) -> Prefilled | None:
        last = self._prompt.finish_chunk(computed)
        if last is None:
            return None
        try:
            return Prefilled(
                self._chooser.choose(*last), self._engine.export_kv(self._prompt.sequence), self._prompt.cached_tokens
            )
        finally:
            self._prompt.release()


class TextModel(Answers):
    """A model on pdchat's engine: its forward passes (`engine`), its grammars, and its output
    side (`Answers`)."""

    def __init__(
        self,
        model_dir: Path,
        device: str = "auto",
        dtype: str = "auto",
        threads: int | None = None,
        grammar: CompileOptions | None = None,
        pool: KVPoolOptions = DEFAULT_KV_POOL,
        forward: str = "auto",
    ):
        """`grammar`: how output grammars compile (the settings' defaults unless given);
        `pool`: the KV block pool's size and prefix caching; `forward`: see CausalLM."""
        self.engine = CausalLM(model_dir, device, dtype, threads, pool, forward)
        super().__init__(model_dir)
        self.constraints = ConstraintCompiler(self.tokenizer, self.engine.vocab_size, grammar or compile_options({}))

    @classmethod
    def for_stage(cls, role: str, settings: ModelSettings, parameters: dict[str, str]) -> TextModel:
        """The model of a `prefill` or `decode` instance (`role`), where `settings` place it,
        its grammar compiles and KV pool as the stage's `parameters` say; its grammar worker
        started, before a request with a grammar waits for it."""
        model = cls(
            settings.path,
            settings.device,
            settings.dtype,
            settings.threads,
            compile_options(parameters),
            kv_pool_options(role, parameters),
            settings.forward,
        )
        model.constraints.start()
        return model

    def close(self) -> None:
        """Stop what runs beside the model (the grammar worker process)."""
        self.constraints.close()

    def prefill(self, prompt_token_ids: list[int], params: GenerationParams) -> Prefilled:
        """Prefill's whole job at once (see PrefillJob)."""
        job = PrefillJob(self, prompt_token_ids, params, chunk=len(prompt_token_ids))
        while (prefilled := job.step()) is None:
            pass
        return prefilled

    def generation(
        self,
        prompt_token_ids: list[int],
        params: GenerationParams,
        *,
        first: Choice | None = None,
        kv_source: KVSource | None = None,
        on_kv_released: Callable[[], None] | None = None,
        prefill_chunk: int | None = None,
        cached_tokens: int = 0,
    ) -> Generation:
        """Decode state continuing from prefill's KV and first token (`cached_tokens`: what
        prefill's prefix cache gave); without them, prefill here: at once, or with
        `prefill_chunk`, chunk by chunk through prefill_step(). `on_kv_released` runs once
        the pool no longer reads what `kv_source` gave."""
        return Generation(
            self,
            prompt_token_ids,
            params,
            first=first,
            kv_source=kv_source,
            on_kv_released=on_kv_released,
            prefill_chunk=prefill_chunk,
            cached_tokens=cached_tokens,
        )

    def chooser(self, prompt_token_ids: list[int], params: GenerationParams) -> TokenChooser:
        """One request's token choice: its grammar, penalties and biases, its seeded draw."""
        if self.harmony is not None:
            self.check_harmony(params)
        shaper = LogitsShaper(params, prompt_token_ids, self.engine.vocab_size, self.min_tokens_suppressed(params))
        return TokenChooser(params, shaper, self.constraints.constraint(params.constraint))


class Generation:
    """Decode state of one request: per-request sampling, grammar, stop conditions and
    text; its KV is a pool sequence (`cache`), held by the request until decode batches
    it, then by the `DecodeBatch` (which sets `cache` to None).

    A step is two halves, so many requests can share one forward pass: `emit()` hands out
    the pending token (and says whether the request is finished), `accept(logits)` picks
    the next one from the logits after it. `advance()` does both on the request's own
    cache, for single-request use.
    """

    def __init__(
        self,
        model: TextModel,
        prompt_token_ids: list[int],
        params: GenerationParams,
        *,
        first: Choice | None,
        kv_source: KVSource | None,
        on_kv_released: Callable[[], None] | None = None,
        prefill_chunk: int | None = None,
        cached_tokens: int = 0,
    ):
        engine = model.engine
        self.engine = engine
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self._answer = AnswerText(model, prompt_token_ids, params)
        self.output_token_ids = self._answer.token_ids
        self.finished = False
        self._chooser = model.chooser(prompt_token_ids, params)
        self._given = first  # prefill's choice: the answer's first token, whoever computes the prompt
        self._on_kv_released = on_kv_released
        self._prefill_chunk = prefill_chunk or len(prompt_token_ids)
        self._local: PromptPrefill | None = None  # decode's own prefill of the prompt
        self.cache = None
        self.cached_tokens = cached_tokens  # prompt tokens a prefix cache gave (prefill's, or this server's)
        self._pending: Choice | None = None
        engine.check_prompt(prompt_token_ids)
        # NOTE: a constructor that raises holds no KV: the pool's blocks it took are released here.
        try:
            if kv_source is not None and first is not None:
                try:
                    self._pending = self._continue_from(first, kv_source)
                finally:
                    self.kv_moved()  # copied into the pool, or refused: hand it back now, not at its TTL
            if self._pending is None and prefill_chunk is None:  # no KV, or its pull failed
                self.prefill_step()  # the whole prompt at once
        except BaseException:
            self.drop()  # e.g. the grammar refused prefill's first token after its KV came in
            raise

    def _continue_from(self, first: Choice, kv_source: KVSource) -> Choice | None:
        """Take over prefill's KV (only the tokens this pool does not cache are pulled) and
        first token; None when the pull failed (decode then computes the prompt itself).
        Logprobs the request asks for that prefill did not hand over (its leg did not ask for
        them, or for fewer alternatives) come from the prompt's last token computed again
        here; logprobs it does not ask for are dropped."""
        params, prompt = self.params, self.prompt_token_ids
        logprobs = first.logprobs if params.logprobs else None
        if params.logprobs and (logprobs is None or not logprobs.covers(first.token_id, params.top_logprobs)):
            imported = self.engine.import_kv_recomputing_last(kv_source, prompt, params.cache_salt)
            if imported is None:
                return None
            logits, self.cache = imported
            logprobs = token_logprobs(logits, first.token_id, params.top_logprobs)
        else:
            self.cache = self.engine.import_kv(kv_source, prompt, params.cache_salt)
            if self.cache is None:
                return None
        self._chooser.replay(first.token_id)  # prefill's choice, into grammar and penalties
        return Choice(first.token_id, None if logprobs is None else logprobs.trimmed(params.top_logprobs))

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still to be computed here (decode prefills in chunks)."""
        return self._pending is None

    def prefill_step(self) -> bool:
        """Compute the next chunk of the prompt's KV (the first chunk starts after the
        prompt's cached prefix); True once the first token is chosen."""
        if self.cache is None:
            self._local = PromptPrefill(self.engine, self.prompt_token_ids, self.params.cache_salt, self._prefill_chunk)
            self.cache = self._local.sequence
        last = self._local.step(self._chooser.greedy and not (self._given and self.params.logprobs))
        self.cached_tokens = self._local.cached_tokens
        if last is None:
            return False
        self._pending = self._chooser.choose(*last) if self._given is None else self._given_again(last[0])
        return True

    def _given_again(self, logits: torch.Tensor) -> Choice:
        """Prefill's first token once decode computed the prompt itself (the KV pull failed):
        its client may have been shown it already (`TextModel.first_output`, a prefill leg's
        answer), so it stays the answer's first token; its logprobs, when asked, from the
        logits computed here."""
        token = self._given.token_id
        self._chooser.replay(token)
        logprobs = token_logprobs(logits, token, self.params.top_logprobs) if self.params.logprobs else None
        return Choice(token, logprobs)

    def emit(self) -> Delta:
        """The pending token as the client sees it (AnswerText.emit); sets `finished` when it is the last."""
        delta = self._answer.emit(self._pending, self.cached_tokens)
        self.finished = bool(delta.finish_reason)
        if self.finished:
            self.drop()  # free the KV as soon as the answer is complete (a batched row's: at its leave)
        return delta

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    @property
    def greedy(self) -> bool:
        """Whether its next token is its logits' argmax and nothing more (TokenChooser.greedy)."""
        return self._chooser.greedy

    def accept(self, logits, argmax: int | None = None) -> None:
        """Choose the next token from the logits that followed the last emitted one
        (`argmax`: theirs, when the caller has it; see TokenChooser.choose)."""
        self._pending = self._chooser.choose(logits, argmax)

    def drop(self) -> None:
        """Give the KV this request holds back to the pool (idempotent)."""
        if self.cache is not None:
            self.cache.release()
            self.cache = None

    def kv_moved(self) -> None:
        """The KV no longer reads the imported memory (copied into the pool, or refused):
        tell whoever handed it over, once."""
        if self._on_kv_released is not None:
            released, self._on_kv_released = self._on_kv_released, None
            released()

    def advance(self) -> Delta:
        """emit() then accept() on the request's own sequence: one request, one forward pass."""
        delta = self.emit()
        if not self.finished:
            self.accept(self.engine.step([self.cache], [self.last_token_id])[0])
        return delta
