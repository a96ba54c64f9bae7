"""Split generated text into content, reasoning_content and tool_calls, as it streams.

Markers: `<think>...</think>` (reasoning) and Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Text that might be the start
of a marker is held back until it is decided; a tool call is emitted whole once closed.
Nothing is dropped: an unparsable tool call comes back as content. The one exception is
`max_tool_calls` (parallel_tool_calls false): generation stops at the call that reaches it,
and what the same token spelled after it is not part of the answer.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

CONTENT, REASONING, TOOL_CALL, DONE = "content", "reasoning", "tool_call", "done"


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


def starts_in_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt left a <think> block open (the answer begins inside it)."""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


class OutputParser:
    def __init__(self, *, reasoning: bool, tools: bool, in_reasoning: bool = False, max_tool_calls: int | None = None):
        self._reasoning = reasoning
        self._tools = tools
        self._max_tool_calls = max_tool_calls
        self._state = REASONING if reasoning and in_reasoning else CONTENT
        self._buffer = ""
        self._tool_count = 0
        self._after_think = False  # drop the blank line the template puts after </think>

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """The text one step added (its token ids are for parsers that read ids: Harmony's)."""
        out = ParsedDelta()
        if self._state == DONE:
            return out
        self._buffer += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """End of output: release what was held back, in the state it was in (nothing once DONE)."""
        out = ParsedDelta()
        rest, self._buffer = self._buffer, ""
        if self._state == REASONING:
            out.reasoning += rest
        elif self._state == TOOL_CALL:
            out.content += TOOL_OPEN + rest
        else:
            out.content += rest
        return out

    def _markers(self) -> list[str]:
        if self._state == REASONING:
            return [THINK_CLOSE]
        if self._state == TOOL_CALL:
            return [TOOL_CLOSE]
        return [m for m, on in ((THINK_OPEN, self._reasoning), (TOOL_OPEN, self._tools)) if on]

    def _step(self, out: ParsedDelta) -> bool:
        """Consume the buffer up to the next marker; False when waiting for more text."""
        if self._after_think and self._state == CONTENT:
            stripped = self._buffer.lstrip("\n")
            if not stripped:
                self._buffer = ""
                return False
            self._buffer, self._after_think = stripped, False
        markers = self._markers()
        hits = [(self._buffer.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if not hits:
            if self._state != TOOL_CALL:
                keep = _partial_marker_suffix(self._buffer, markers)
                self._emit(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        index, marker = min(hits)
        before, self._buffer = self._buffer[:index], self._buffer[index + len(marker) :]
        if self._state == TOOL_CALL:
            call = self._tool_call(before)
            self._state = CONTENT
            if call is None:
                out.content += TOOL_OPEN + before + TOOL_CLOSE
            else:
                out.tool_calls.append(call)
                if self._tool_count == self._max_tool_calls:
                    self._state, self._buffer = DONE, ""
                    return False
            return True
        self._emit(out, before)
        if marker == THINK_OPEN:
            self._state = REASONING
        elif marker == THINK_CLOSE:
            self._state, self._after_think = CONTENT, True
        else:
            self._state = TOOL_CALL
        return True

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if self._state == REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _tool_call(self, body: str) -> dict[str, Any] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        index, self._tool_count = self._tool_count, self._tool_count + 1
        return {
            "index": index,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
        }


def _partial_marker_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that could begin a marker."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-length:]):
                best = length
                break
    return best
