"""One request's decode: feed tokens, stop on EOS / length / stop strings, emit text deltas."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdchat.core.detokenizer import IncrementalDetokenizer
from pdchat.core.engine import CausalLM
from pdchat.core.protocol import GenerationParams
from pdchat.core.sampling import choose_token
from pdchat.core.stopping import StopStringMatcher

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class Delta:
    """What one decode step adds: one token, its text (maybe empty), maybe the end."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


def eos_token_ids(engine: CausalLM, tokenizer) -> frozenset[int]:
    """EOS ids from both the generation config and the tokenizer (chat models differ)."""
    ids = set()
    for source in (getattr(engine.model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return frozenset(ids)


def first_token(engine: CausalLM, logits, params: GenerationParams) -> int:
    """The token prefill hands over: output position 0."""
    return choose_token(logits, temperature=params.temperature, top_p=params.top_p, seed=params.seed, position=0)


class Generation:
    """Decode state of one request. `advance()` emits one token per call until finished."""

    def __init__(
        self,
        engine: CausalLM,
        tokenizer,
        eos_ids: frozenset[int],
        prompt_token_ids: list[int],
        params: GenerationParams,
        *,
        first_token_id: int | None = None,
        kv_cache: np.ndarray | None = None,
    ):
        """With prefill's KV and first token, continue from them; without, prefill here."""
        self.engine = engine
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self._eos = frozenset() if params.ignore_eos else eos_ids
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(params.stop)
        if kv_cache is not None and first_token_id is not None:
            engine.check_prompt(prompt_token_ids)
            self._cache = engine.import_kv(kv_cache, len(prompt_token_ids))
            self._pending = first_token_id
        else:
            result = engine.prefill(prompt_token_ids)
            self._cache = result.cache
            self._pending = first_token(engine, result.last_logits, params)

    def advance(self) -> Delta:
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
        if finish:
            self._cache = None  # free the KV as soon as the answer is complete
        else:
            logits = self.engine.step(token, self._cache)
            self._pending = choose_token(
                logits,
                temperature=self.params.temperature,
                top_p=self.params.top_p,
                seed=self.params.seed,
                position=len(self.output_token_ids),
            )
        return Delta(released, [token], finish)


def prefill_for_handoff(engine: CausalLM, prompt_token_ids: list[int], params: GenerationParams) -> tuple[int, np.ndarray]:
    """Prefill's whole job: the first output token and the prompt's KV for decode."""
    result = engine.prefill(prompt_token_ids)
    return first_token(engine, result.last_logits, params), engine.export_kv(result.cache)
