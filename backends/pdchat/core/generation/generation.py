"""Prefill and decode of one model: first token + KV, then one token per step.

`TextModel` bundles what both stages need (engine, tokenizer, EOS ids, grammar
compiler), so the prefill and decode models and the in-process pipeline share one
implementation of sampling, constraints and stop conditions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdchat.core.generation.constraints import Constraint, ConstraintCompiler
from pdchat.core.generation.engine import CausalLM
from pdchat.core.generation.sampling import choose_token
from pdchat.core.output.detokenizer import IncrementalDetokenizer
from pdchat.core.output.parsing import THINK_OPEN, OutputParser, starts_in_reasoning
from pdchat.core.output.responses import Delta, ResponseAssembler
from pdchat.core.output.stopping import StopStringMatcher
from pdchat.core.request.protocol import GenerationParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# Prompt tokens decoded to see whether the prompt left a <think> block open.
PROMPT_TAIL_TOKENS = 16


class TextModel:
    def __init__(self, model_dir: Path, device: str = "auto"):
        from transformers import AutoTokenizer

        self.engine = CausalLM(model_dir, device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = self._eos_ids()
        self.constraints = ConstraintCompiler(self.tokenizer, self.engine.vocab_size)
        self.reasoning = THINK_OPEN in (self.tokenizer.chat_template or "")

    def prefill(self, prompt_token_ids: list[int], params: GenerationParams) -> tuple[int, np.ndarray]:
        """Prefill's whole job: the first output token and the prompt's KV for decode."""
        constraint = self.constraints.constraint(params.constraint)
        result = self.engine.prefill(prompt_token_ids)
        return choose(result.last_logits, params, 0, constraint), self.engine.export_kv(result.cache)

    def generation(
        self,
        prompt_token_ids: list[int],
        params: GenerationParams,
        *,
        first_token_id: int | None = None,
        kv_cache: np.ndarray | None = None,
        on_kv_released: Callable[[], None] | None = None,
        prefill_chunk: int | None = None,
    ) -> Generation:
        """Decode state continuing from prefill's KV and first token; without them, prefill
        here: at once, or with `prefill_chunk`, chunk by chunk through prefill_step().
        `on_kv_released` runs once the cache no longer reads `kv_cache`'s memory."""
        return Generation(self, prompt_token_ids, params, first_token_id=first_token_id, kv_cache=kv_cache,
                          on_kv_released=on_kv_released, prefill_chunk=prefill_chunk)

    def assembler(self, prompt_token_ids: list[int], params: GenerationParams) -> ResponseAssembler:
        tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        parser = OutputParser(
            reasoning=self.reasoning, tools=params.parse_tool_calls, in_reasoning=starts_in_reasoning(tail)
        )
        return ResponseAssembler(params, prompt_token_ids, parser)

    def _eos_ids(self) -> frozenset[int]:
        """EOS ids from both the generation config and the tokenizer (chat models differ)."""
        ids = set()
        for source in (getattr(self.engine.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if source is not None:
                ids.update(source if isinstance(source, list) else [source])
        return frozenset(ids)


def choose(logits, params: GenerationParams, position: int, constraint: Constraint | None) -> int:
    """Sample output `position` within the request's grammar, if it has one."""
    if constraint is not None:
        logits = constraint.mask(logits)
    token = choose_token(logits, temperature=params.temperature, top_p=params.top_p, seed=params.seed, position=position)
    if constraint is not None:
        constraint.accept(token)
    return token


class Generation:
    """Decode state of one request: per-request sampling, grammar, stop conditions and
    text; the KV lives in the request's own cache or, once decode has batched it, in a
    `DecodeBatch` row.

    A step is two halves, so many requests can share one forward pass: `emit()` hands out
    the pending token (and says whether the request is finished), `accept(logits)` picks
    the next one from the logits after it. `advance()` does both on the request's own
    cache, for single-request use.
    """

    def __init__(self, model: TextModel, prompt_token_ids: list[int], params: GenerationParams, *,
                 first_token_id: int | None, kv_cache: np.ndarray | None,
                 on_kv_released: Callable[[], None] | None = None, prefill_chunk: int | None = None):
        engine = model.engine
        self.engine = engine
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.finished = False
        self._eos = frozenset() if params.ignore_eos else model.eos_ids
        self._detokenizer = IncrementalDetokenizer(model.tokenizer)
        self._stops = StopStringMatcher(params.stop)
        self._constraint = model.constraints.constraint(params.constraint)
        self._on_kv_released = on_kv_released
        self._prefill_chunk = prefill_chunk or len(prompt_token_ids)
        self._prefilled = 0
        self.cache = None
        self._pending: int | None = None
        engine.check_prompt(prompt_token_ids)
        if kv_cache is not None and first_token_id is not None:
            self.cache = engine.import_kv(kv_cache, len(prompt_token_ids))
            self._prefilled = len(prompt_token_ids)
            self._pending = first_token_id
            if self._constraint is not None:
                self._constraint.accept(first_token_id)  # replay prefill's choice into the grammar
        elif prefill_chunk is None:
            self.prefill_step()  # the whole prompt at once

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still to be computed here (decode prefills in chunks)."""
        return self._pending is None

    def prefill_step(self) -> bool:
        """Compute the next chunk of the prompt's KV; True once the first token is chosen."""
        end = min(len(self.prompt_token_ids), self._prefilled + self._prefill_chunk)
        result = self.engine.prefill_chunk(self.prompt_token_ids[self._prefilled:end], self.cache)
        self.cache, self._prefilled = result.cache, end
        if end == len(self.prompt_token_ids):
            self._pending = choose(result.last_logits, self.params, 0, self._constraint)
            return True
        return False

    def emit(self) -> Delta:
        """The pending token as the client sees it; sets `finished` when it is the last."""
        token = self._pending
        self.output_token_ids.append(token)
        finish = None
        text = self._detokenizer.push(token)
        if token in self._eos:
            finish = FINISH_STOP
        elif len(self.output_token_ids) >= self.params.max_tokens:
            finish = FINISH_LENGTH
        if finish:
            text += self._detokenizer.flush()
        released, hit_stop = self._stops.feed(text)
        if hit_stop:
            finish = FINISH_STOP
        elif finish:
            released += self._stops.flush()
        self.finished = bool(finish)
        if self.finished:
            self.cache = None  # free the KV as soon as the answer is complete
        return Delta(released, [token], finish)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    def accept(self, logits) -> None:
        """Choose the next token from the logits that followed the last emitted one."""
        self._pending = choose(logits, self.params, len(self.output_token_ids), self._constraint)

    def kv_moved(self) -> None:
        """The KV no longer reads the imported memory (grown into new tensors, copied into a
        batch, or freed): tell whoever handed it over, once."""
        if self._on_kv_released is not None:
            released, self._on_kv_released = self._on_kv_released, None
            released()

    def advance(self) -> Delta:
        """emit() then accept() on the request's own cache: one request, one forward pass."""
        delta = self.emit()
        if not self.finished:
            self.accept(self.engine.step(self.last_token_id, self.cache))
        self.kv_moved()
        return delta
