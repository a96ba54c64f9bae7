"""Incremental detokenization: text deltas that never split a UTF-8 character.

Byte-level BPE can spread one character over several tokens; decoding the tail again
with one token of left context and holding back while the text ends in U+FFFD gives
deltas whose concatenation equals decoding all ids at once.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window re-decoded each time
        self._read_offset = 0  # ids before this are already emitted as text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: emit what was held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]
