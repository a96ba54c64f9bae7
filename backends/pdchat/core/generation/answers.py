"""What an answer's tokens show its client, whatever engine samples them.

`Answers` holds a model's output side (tokenizer, EOS ids, reasoning and tool-call parsing,
Harmony): it makes each request's `AnswerText` (token -> delta: text, stop conditions) and
its `ResponseAssembler` (deltas -> client outputs). pdchat's own engine (`TextModel`) and
vLLM's (core.vllm) run every token through the same two, so an answer reads the same on
both engines. No torch (transformers for the tokenizer only), no engine state here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pdchat.core.errors import InvalidRequest
from pdchat.core.output.detokenizer import IncrementalDetokenizer
from pdchat.core.output.harmony import HarmonyOutputParser
from pdchat.core.output.logprobs import TokenSpeller
from pdchat.core.output.parsing import THINK_OPEN, OutputParser, starts_in_reasoning
from pdchat.core.output.responses import ClientOutput, Delta, ResponseAssembler, response_assembler
from pdchat.core.output.stopping import StopStringMatcher
from pdchat.core.request.harmony_vocab import harmony_encoding, uses_harmony
from pdchat.core.request.protocol import GenerationParams

if TYPE_CHECKING:
    from pdchat.core.generation.sampling import Choice

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# Prompt tokens decoded to see whether the prompt left a <think> block open.
PROMPT_TAIL_TOKENS = 16


class Answers:
    """A model's output side, from its directory: tokenizer, EOS ids (the generation config's
    and the tokenizer's), whether its template reasons (<think>), Harmony (GPT-OSS)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = _eos_ids(model_dir, self.tokenizer)
        self.reasoning = THINK_OPEN in (self.tokenizer.chat_template or "")
        self.speller = TokenSpeller(self.tokenizer)
        self.harmony = harmony_encoding() if uses_harmony(model_dir) else None

    @staticmethod
    def check_harmony(params: GenerationParams) -> None:
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

    def min_tokens_suppressed(self, params: GenerationParams) -> frozenset[int]:
        """Tokens min_tokens keeps out of the answer's first tokens: EOS, even with ignore_eos
        (as vLLM's), and the request's stop_token_ids."""
        return self.eos_ids | frozenset(params.stop_token_ids)

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
        delta = AnswerText(self, prompt_token_ids, params).emit(replace(first, logprobs=logprobs), cached_tokens)
        if delta.finish_reason:
            return None
        [output] = self.assembler(prompt_token_ids, params).on_delta(delta)
        return output


class AnswerText:
    """What one request's output tokens show its client, token by token: a stop token (EOS,
    stop_token_ids) ends the answer without adding text, as in vLLM; text is detokenized
    incrementally and held back where a stop string may begin; the answer ends at a stop
    string (one ending after its first min_tokens tokens), the first complete tool call
    (parallel_tool_calls false) or max_tokens.

    NOTE: it reads no engine state: decode runs it for every token (`Generation`), prefill
    for the first one alone (`TextModel.first_output`), and both show the same delta."""

    def __init__(self, model: Answers, prompt_token_ids: list[int], params: GenerationParams):
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
        # NOTE: as vLLM's min_tokens: no stop string ends within the answer's first min_tokens tokens.
        released, hit_stop = self._stops.feed(text, match=len(self.token_ids) > self.params.min_tokens)
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


def _eos_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """EOS ids from both the generation config (the model config's where the model has none,
    as transformers' models do) and the tokenizer: chat models differ."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    ids = set()
    for source in (generation.eos_token_id, tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return frozenset(ids)
