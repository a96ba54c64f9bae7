"""Log-probabilities of chosen tokens: the typed value that travels, and OpenAI's shape.

`TokenLogprobs` is computed where a token is chosen (core.generation.sampling), so the
first token's entry is made by prefill and has to reach decode: inside one server as
the `first_token_logprobs` tensor, across servers inside the signed KV handle. Both carry
`to_dict()`; `from_dict()` checks what another process sent.

The values are the model's raw distribution (log_softmax of its logits before the grammar
mask, penalties, biases and temperature), vLLM's default `raw_logprobs` (docs/client-contract.md).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class TokenLogprobs:
    """One chosen token's log-probability and its `top` alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top": [[token, logprob] for token, logprob in self.top],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, value: Any) -> TokenLogprobs:
        """Raises ValueError naming what is wrong: the entry comes from another process."""
        if not isinstance(value, dict) or not isinstance(value.get("top"), list):
            raise ValueError("token logprobs must be {'token_id': int, 'logprob': float, 'top': [[int, float], ...]}")
        top = tuple((_token_id(pair[0]), _logprob(pair[1])) for pair in value["top"] if _is_pair(pair))
        if len(top) != len(value["top"]):
            raise ValueError("token logprobs 'top' must be a list of [token_id, logprob] pairs")
        return cls(_token_id(value.get("token_id")), _logprob(value.get("logprob")), top)

    @classmethod
    def from_json(cls, text: str) -> TokenLogprobs:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError as exc:
            raise ValueError(f"malformed token logprobs: {exc}") from None

    def covers(self, token_id: int, top_logprobs: int) -> bool:
        """Whether this entry answers a request for `token_id` with `top_logprobs` alternatives."""
        return self.token_id == token_id and len(self.top) >= top_logprobs

    def trimmed(self, top_logprobs: int) -> TokenLogprobs:
        return (
            self
            if len(self.top) == top_logprobs
            else TokenLogprobs(self.token_id, self.logprob, self.top[:top_logprobs])
        )


def _is_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2


def _token_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a token id must be a non-negative integer, got {value!r}")
    return value


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value > 0:
        raise ValueError(f"a logprob must be a number <= 0, got {value!r}")
    return float(value)


class Tokenizer(Protocol):
    def convert_ids_to_tokens(self, ids: int) -> str: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TokenSpeller:
    """Each token's text and UTF-8 bytes as OpenAI's logprobs show them.

    A byte-level BPE token (GPT-2 style, SmolLM2's) may hold part of a character: its
    `bytes` are the exact bytes and its `token` their UTF-8 reading (U+FFFD for a partial
    character), as OpenAI reports them. Other tokenizers spell a token by decoding it alone.
    Spellings are cached per id (at most the vocabulary).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._spelled: dict[int, tuple[str, list[int]]] = {}

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        spelled = self._spelled.get(token_id)
        if spelled is None:
            raw = self._byte_level_bytes(token_id)
            if raw is None:
                raw = self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
            spelled = self._spelled[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return spelled

    def content(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """OpenAI's `choices[0].logprobs.content` for these tokens."""
        return [
            {**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]

    def completion_logprobs(self, entries: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        """The completions API's `choices[0].logprobs` for these tokens: their spellings,
        logprobs, alternatives ({spelling: logprob}) and `text_offset`s, the first at `offset`
        characters into the choice's text (as vLLM counts them: the spellings' lengths)."""
        tokens = [self.spell(e.token_id)[0] for e in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.spell(t)[0]: lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def text(self, token_ids: list[int]) -> str:
        """The ids' text, special tokens kept (what `echo` shows of a prompt)."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token, raw = self.spell(token_id)
        return {"token": token, "logprob": logprob, "bytes": raw}

    def _byte_level_bytes(self, token_id: int) -> bytes | None:
        if not self._byte_level:
            return None
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or any(ch not in _BYTE_OF_CHAR for ch in piece):
            return None  # an added token spelled in plain text
        return bytes(_BYTE_OF_CHAR[ch] for ch in piece)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the others for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()
