"""Constrained decoding: a request's grammar (core.request.grammar spec) compiled
against the model's tokenizer, masking logits token by token."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch

from pdchat.core.errors import InvalidRequest
from pdchat.core.request.grammar import grammar_for


class Constraint:
    """One request's grammar state: masks logits, accepts the chosen tokens."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().cpu().clone().unsqueeze(0)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask)
        return logits[0]

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise InvalidRequest(f"token {token_id} breaks the request's output grammar")


class ConstraintCompiler:
    """Compiles specs for one tokenizer, caching compiled grammars by spec."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler = None

    def constraint(self, spec: dict[str, Any] | None) -> Constraint | None:
        if spec is None:
            return None
        return Constraint(self._compiled(json.dumps(spec, sort_keys=True)), self._vocab_size)

    @lru_cache(maxsize=256)  # noqa: B019 - one compiler per model process, lives as long
    def _compiled(self, spec_json: str):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler.compile_grammar(grammar_for(json.loads(spec_json)))
