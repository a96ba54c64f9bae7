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
from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.constraints import ConstraintCompiler
from pdchat.core.generation.engine import CausalLM, KVSource, PromptPrefill
from pdchat.core.generation.sampling import Choice, LogitsShaper, TokenChooser, token_logprobs
from pdchat.core.output.detokenizer import IncrementalDetokenizer
from pdchat.core.output.harmony import HarmonyOutputParser
from pdchat.core.output.logprobs import TokenSpeller
from pdchat.core.output.parsing import THINK_OPEN, OutputParser, starts_in_reasoning
from pdchat.core.output.responses import ClientOutput, Delta, ResponseAssembler, response_assembler
from pdchat.core.output.stopping import StopStringMatcher
from pdchat.core.request.harmony_vocab import harmony_encoding, uses_harmony
from pdchat.core.request.protocol import GenerationParams
from pdchat.core.settings import DEFAULT_KV_POOL, CompileOptions, KVPoolOptions, compile_options, kv_pool_options
from pdchat.models import ModelSettings

if TYPE_CHECKING:
    import torch

    from pdchat.models import ModelSettings

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# Prompt tokens decoded to see whether the prompt left a <think> block open.
PROMPT_TAIL_TOKENS = 16


class PrefillJob:
    """Prefill's whole job, chunk by chunk: the first output token (with its logprobs, if
    asked) and the prompt's KV for decode. The prompt's full blocks stay in the pool's
    prefix cache. Abandoned before its end, it must be `abandon()`ed (its blocks go back)."""

    def __init__(self, model: TextModel, prompt_token_ids: list[int], params: GenerationParams, chunk: int):
        self._chooser = model.chooser(prompt_token_ids, params)
        self._engine = model.engine
        self._prompt = PromptPrefill(model.engine, prompt_token_ids, params.cache_salt, chunk)

    @property
    def remaining(self) -> int:
        return self._prompt.remaining

    def step(self) -> Prefilled | None:
        """One chunk; the result once the prompt is complete (the sequence then released)."""
        last = self._prompt.step(self._chooser.greedy)
        if last is None:
            return None
        try:
            return Prefilled(
                self._chooser.choose(*last), self._engine.export_kv(self._prompt.sequence), self._prompt.cached_tokens
            )
        finally:
            self._prompt.release()

    def abandon(self) -> None:
        self._prompt.release()


class TextModel:
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
        from transformers import AutoTokenizer

        self.engine = CausalLM(model_dir, device, dtype, threads, pool, forward)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = self._eos_ids()
        self.constraints = ConstraintCompiler(self.tokenizer, self.engine.vocab_size, grammar or compile_options({}))
        self.reasoning = THINK_OPEN in (self.tokenizer.chat_template or "")
        self.speller = TokenSpeller(self.tokenizer)
        self.harmony = harmony_encoding() if uses_harmony(model_dir) else None

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
            self._check_harmony(params)
        shaper = LogitsShaper(params, prompt_token_ids, self.engine.vocab_size, self.stop_ids(params))
        return TokenChooser(params, shaper, self.constraints.constraint(params.constraint))

    @staticmethod
    def _check_harmony(params: GenerationParams) -> None:
        """What the Harmony path cannot honour yet, refused here where both the render and the
        reuse paths pass: a grammar would have to start after the `final` header, and stop
        strings would match header words and leave the parsed content untrimmed."""
        if params.constraint is not None:
            raise InvalidRequest(
                "response_format and a forced tool_choice ('required' or a named function) are not "
                "supported with the Harmony format (GPT-OSS) yet; use tool_choice 'auto'"
            )
        if params.stop:
            raise InvalidRequest(
                "'stop' strings are not supported with the Harmony format (GPT-OSS) yet; use stop_token_ids"
            )

    def stop_ids(self, params: GenerationParams) -> frozenset[int]:
        """Tokens that end an answer: EOS (unless ignore_eos) and the request's stop_token_ids."""
        return (frozenset() if params.ignore_eos else self.eos_ids) | frozenset(params.stop_token_ids)

    def output_parser(
        self, prompt_token_ids: list[int], params: GenerationParams
    ) -> OutputParser | HarmonyOutputParser:
        """Splits the answer into content, reasoning and tool calls (at most one with
        parallel_tool_calls false): by Harmony's tokens, or by the text's markers."""
        max_tool_calls = None if params.parallel_tool_calls else 1
        if self.harmony is not None:
            return HarmonyOutputParser(
                self.harmony, self._decode, tools=params.parse_tool_calls, max_tool_calls=max_tool_calls
            )
        tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        return OutputParser(
            reasoning=self.reasoning,
            tools=params.parse_tool_calls,
            in_reasoning=starts_in_reasoning(tail),
            max_tool_calls=max_tool_calls,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def assembler(
        self, prompt_token_ids: list[int], params: GenerationParams, *, first_output_sent: bool = False
    ) -> ResponseAssembler:
        """The request's outputs, delta by delta; `first_output_sent`: its client has the
        first one already (`first_output`), so the first delta adds none unless it is the last."""
        parser = self.output_parser(prompt_token_ids, params)
        return response_assembler(params, prompt_token_ids, parser, self.speller, first_output_sent=first_output_sent)

    def first_output(
        self, prompt_token_ids: list[int], params: GenerationParams, first: Choice, cached_tokens: int
    ) -> ClientOutput | None:
        """A streamed answer's first output, from prefill's first token, as decode will make
        it (the same AnswerText delta into the same assembler): its client can have it
        before decode sends anything, and decode's assembler then skips it
        (`assembler(first_output_sent=True)`). None where decode's could differ or end the
        answer: not streamed, logprobs asked that prefill did not compute (decode computes
        them again), a first token that is the answer's last."""
        if not params.stream:
            return None
        logprobs = None
        if params.logprobs:
            if first.logprobs is None or not first.logprobs.covers(first.token_id, params.top_logprobs):
                return None
            logprobs = first.logprobs.trimmed(params.top_logprobs)  # as decode's Generation takes it
        delta = AnswerText(self, prompt_token_ids, params).emit(Choice(first.token_id, logprobs), cached_tokens)
        if delta.finish_reason:
            return None
        [output] = self.assembler(prompt_token_ids, params).on_delta(delta)
        return output

    def _eos_ids(self) -> frozenset[int]:
        """EOS ids from both the generation config and the tokenizer (chat models differ)."""
        ids = set()
        for source in (getattr(self.engine.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if source is not None:
                ids.update(source if isinstance(source, list) else [source])
        return frozenset(ids)


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
            self.cache, self.cached_tokens = self._local.sequence, self._local.cached_tokens
        last = self._local.step(self._chooser.greedy and not (self._given and self.params.logprobs))
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


class AnswerText:
    """What one request's output tokens show its client, token by token: a stop token (EOS,
    stop_token_ids) ends the answer without adding text, as in vLLM; text is detokenized
    incrementally and held back where a stop string may begin; the answer ends at a stop
    string, the first complete tool call (parallel_tool_calls false) or max_tokens.

    NOTE: it reads no engine state: decode runs it for every token (`Generation`), prefill
    for the first one alone (`TextModel.first_output`), and both show the same delta."""

    def __init__(self, model: TextModel, prompt_token_ids: list[int], params: GenerationParams):
        self.params = params
        self.token_ids: list[int] = []
        self._stop_ids = model.stop_ids(params)
        self._detokenizer = IncrementalDetokenizer(model.tokenizer)
        self._stops = StopStringMatcher(params.stop)
        # parallel_tool_calls false: a parser of its own watches for the first complete call.
        one_call = params.parse_tool_calls and not params.parallel_tool_calls
        self._tool_call_watch = model.output_parser(prompt_token_ids, params) if one_call else None

    def emit(self, choice: Choice, cached_tokens: int) -> Delta:
        """The delta of the answer's next token (`cached_tokens` goes on the first one)."""
        token = choice.token_id
        self.token_ids.append(token)
        stopped = token in self._stop_ids
        text = "" if stopped else self._detokenizer.push(token)
        first = len(self.token_ids) == 1
        finish = self._finish(stopped, text)
        if finish:
            text += self._detokenizer.flush()
        released, hit_stop = self._stops.feed(text)
        if hit_stop:
            finish = FINISH_STOP
        elif finish:
            released += self._stops.flush()
        logprobs = [] if choice.logprobs is None else [choice.logprobs]
        return Delta(released, [token], finish, logprobs, cached_tokens if first else None)

    def _finish(self, stopped: bool, text: str) -> str | None:
        if stopped:
            return FINISH_STOP
        if self._tool_call_watch is not None and self._tool_call_watch.feed(text, [self.token_ids[-1]]).tool_calls:
            return FINISH_STOP  # the first complete tool call (the client sees finish_reason tool_calls)
        if len(self.token_ids) >= self.params.max_tokens:
            return FINISH_LENGTH
        return None
