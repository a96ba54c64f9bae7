"""Next-token choice for one request: its logits shaped by its own penalties and biases,
then greedy at temperature 0, else temperature, min-p, top-k, top-p and a seeded draw.

The random stream is keyed by (seed, output position), not by process state, and the
shaping state (token counts) is rebuilt from the prompt and the tokens chosen so far, so
the same request samples the same tokens whichever server computed which position:
prefill chooses position 0, decode replays it and chooses the rest.

Order, as vLLM applies them: grammar mask (core.generation.constraints), min_tokens
suppression, logit_bias, repetition penalty, frequency and presence penalties; then
temperature, min_p, top_k, top_p. Logprobs are the raw distribution, before all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.core.request.protocol import GenerationParams, SamplingOptions

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) apart


@dataclass(frozen=True)
class Choice:
    """A chosen token, with its raw logprobs when the request asked for them."""

    token_id: int
    logprobs: TokenLogprobs | None = None


def choose_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    seed: int,
    position: int,
    top_k: int = 0,
    min_p: float = 0.0,
) -> int:
    """Pick the token at output `position` from 1-D `logits` over the vocabulary: the
    argmax at temperature 0 (or top_k 1), else a draw from the tempered distribution that
    min_p, top_k and top_p leave, by inverse transform: one uniform number from the
    (seed, position) stream, found in the kept tokens' cumulative mass. No argsort and no
    multinomial: top_p finds its threshold by sorting the probabilities' values alone
    (numpy's sort, several times faster than torch's sort with indices)."""
    logits = logits.float().cpu()
    if temperature == 0.0 or top_k == 1:  # NOTE: as TokenChooser.greedy, so the greedy head agrees
        return int(torch.argmax(logits))
    probs = _keep_likely(torch.softmax(logits / temperature, dim=-1), top_k=top_k, min_p=min_p)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    generator = torch.Generator().manual_seed((seed * _MIX + position) % (1 << 63))
    cumulative = torch.cumsum(probs, dim=-1)
    drawn = torch.rand((), generator=generator) * cumulative[-1]
    # NOTE: the first index whose cumulative mass passes the draw holds a kept (non-zero) token.
    return min(int(torch.searchsorted(cumulative, drawn, right=True)), probs.numel() - 1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` with the tokens outside the nucleus zeroed: those less likely than the
    smallest prefix of the likeliest whose mass reaches top_p (at least one token; tokens
    as likely as its last are kept with it)."""
    ordered = np.sort(probs.numpy())[::-1]
    mass_before = np.cumsum(ordered) - ordered
    kept = max(1, int(np.count_nonzero(mass_before < top_p * ordered.sum())))
    return torch.where(probs < float(ordered[kept - 1]), 0.0, probs)


def _keep_likely(probs: torch.Tensor, *, top_k: int, min_p: float) -> torch.Tensor:
    """min_p (below min_p times the likeliest token's probability), then top_k, drop tokens;
    the rest is renormalized, so top_p then measures mass among what is left (as vLLM)."""
    if min_p <= 0.0 and not 0 < top_k < probs.numel():
        return probs
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    if 0 < top_k < probs.numel():
        probs = torch.where(probs < torch.topk(probs, top_k).values[-1], 0.0, probs)
    return probs / probs.sum()


def suppress(logits: torch.Tensor, token_ids: torch.Tensor) -> None:
    """-inf for `token_ids`, in place, unless nothing else could be chosen (a grammar that
    allows only EOS now): then the grammar wins and they stay."""
    kept = logits[token_ids].clone()
    logits[token_ids] = float("-inf")
    if not torch.isfinite(logits).any():
        logits[token_ids] = kept


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """vLLM/HF: each token seen in prompt or output, its logit divided by `penalty` if
    positive, multiplied if not (so > 1 always makes it less likely). In place."""
    scores = logits[seen]
    logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float) -> None:
    """OpenAI: minus frequency x (times the token is in the output) minus presence x (whether
    it is). In place."""
    logits -= frequency * counts + presence * (counts > 0).float()


def token_logprobs(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    """Raw log-probabilities from unprocessed logits: the chosen token's and the `top` likeliest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id, float(logprobs[token_id]), alternatives)


class LogitsShaper:
    """One request's min_tokens, logit_bias and penalties over its own prompt and output.

    Each request has its own (the batched step hands each row's logits to its request), and
    one that asks for none of them costs nothing per token: no state, no copy.
    """

    def __init__(
        self, options: SamplingOptions, prompt_token_ids: list[int], vocab_size: int, suppressed: frozenset[int]
    ):
        """`suppressed`: the tokens kept out until min_tokens tokens are out."""
        self._options = options
        self.produced = 0  # output tokens chosen (or replayed) so far
        self._suppressed = (
            torch.tensor(sorted(suppressed), dtype=torch.long) if options.min_tokens and suppressed else None
        )
        self._bias = None
        if options.logit_bias:
            self._bias = (
                torch.tensor([int(k) for k in options.logit_bias], dtype=torch.long),
                torch.tensor(list(options.logit_bias.values()), dtype=torch.float32),
            )
        self._seen = None
        if options.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)
            self._seen[torch.tensor(prompt_token_ids, dtype=torch.long)] = True
        penalised = options.frequency_penalty or options.presence_penalty
        self._counts = torch.zeros(vocab_size, dtype=torch.float32) if penalised else None

    @property
    def active(self) -> bool:
        """Whether the next position's logits are shaped at all: min_tokens counts only until
        that many tokens are out, so a request asking for nothing else goes greedy then."""
        suppressing = self._suppressed is not None and self.produced < self._options.min_tokens
        return suppressing or any(state is not None for state in (self._bias, self._seen, self._counts))

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The shaped logits for the next position: a new tensor, `logits` is left alone."""
        if not self.active:
            return logits
        options, logits = self._options, logits.clone()
        if self._suppressed is not None and self.produced < options.min_tokens:
            suppress(logits, self._suppressed)
        if self._bias is not None:
            logits.index_add_(0, *self._bias)
        if self._seen is not None:
            apply_repetition_penalty(logits, self._seen, options.repetition_penalty)
        if self._counts is not None:
            apply_frequency_presence(logits, self._counts, options.frequency_penalty, options.presence_penalty)
        return logits

    def record(self, token_id: int) -> None:
        self.produced += 1
        if self._seen is not None:
            self._seen[token_id] = True
        if self._counts is not None:
            self._counts[token_id] += 1


class Grammar(Protocol):
    """A request's output grammar (core.generation.constraints.Constraint)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token_id: int) -> None: ...


class TokenChooser:
    """Everything that picks one request's tokens: grammar, shaping, the seeded draw and,
    when asked, raw logprobs. `choose()` each position; `replay()` a token chosen
    elsewhere (prefill's first), so that grammar and penalties continue from it."""

    def __init__(self, params: GenerationParams, shaper: LogitsShaper, grammar: Grammar | None):
        self._params = params
        self._shaper = shaper
        self._grammar = grammar

    @property
    def greedy(self) -> bool:
        """Whether the choice is the logits' argmax and nothing more: temperature 0 or top_k 1
        (the draw's only candidate is the argmax), no grammar, no shaping (now), no logprobs."""
        params = self._params
        argmax_only = params.temperature == 0.0 or params.top_k == 1
        return argmax_only and self._grammar is None and not params.logprobs and not self._shaper.active

    def choose(self, logits: torch.Tensor | None, argmax: int | None = None) -> Choice:
        """The next token from `logits`; `argmax`, when given, is theirs (a batched step
        computes it once for all its rows), and a `greedy` chooser takes it as is.

        NOTE: `logits` may be None only with an `argmax` for a `greedy` chooser (the
        GreedyHead decided the token without them)."""
        if argmax is not None and self.greedy:
            self.replay(argmax)
            return Choice(argmax)
        params = self._params
        raw = logits.float().cpu()
        shaped = self._shaper.shape(raw if self._grammar is None else self._grammar.mask(raw))
        token = choose_token(
            shaped,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            position=self._shaper.produced,
        )
        logprobs = token_logprobs(raw, token, params.top_logprobs) if params.logprobs else None
        self.replay(token)
        return Choice(token, logprobs)

    def replay(self, token_id: int) -> None:
        if self._grammar is not None:
            self._grammar.accept(token_id)
        self._shaper.record(token_id)
