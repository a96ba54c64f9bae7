"""Split a Harmony (GPT-OSS) completion into reasoning, content and tool calls, as it streams.

Harmony marks structure with special tokens, so this parser reads token ids, not text,
through openai-harmony's StreamableParser: `analysis` -> reasoning_content, `final` (and
`commentary` addressed to no one, a preamble) -> content, a `commentary` message to
`functions.<name>` -> one OpenAI tool call, emitted whole once the message ends
(`<|call|>`). Content streams token by token.

Nothing is dropped: text the parser cannot place (a model that does not follow Harmony,
a header that never ends, a call to a tool outside `functions`, a call cut off by
max_tokens) comes back as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pdchat.core.output.parsing import ParsedDelta
from pdchat.core.request.harmony_vocab import FUNCTIONS

FUNCTIONS_PREFIX = f"{FUNCTIONS}."
# A header longer than this is not a header: the model is not writing Harmony.
MAX_HEADER_TOKENS = 64


class HarmonyOutputParser:
    """Feeds each output token to openai-harmony's StreamableParser; same interface as
    OutputParser (`feed`, `finish`), token ids being what it reads."""

    def __init__(
        self, encoding: Any, decode: Callable[[list[int]], str], *, tools: bool, max_tool_calls: int | None = None
    ):
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self._decode = decode  # ids -> text, for what is passed on raw
        self._tools = tools
        self._max_tool_calls = max_tool_calls
        self._tool_count = 0
        self._header: list[int] = []  # tokens of a header not yet closed by <|message|>
        self._held: list[str] = []  # a message to a recipient (a tool call's arguments), passed on at its end
        self._raw = False  # the output left Harmony: everything from here is content
        self._done = False

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        for token in token_ids:
            if self._done:
                break
            if self._raw:
                out.content += self._decode([token])
                continue
            self._process(token, out)
        return out

    def finish(self) -> ParsedDelta:
        """End of output: a header or call left open is passed on as content."""
        out = ParsedDelta()
        if not (self._raw or self._done):
            self._leave_harmony(out)
        return out

    def _process(self, token: int, out: ParsedDelta) -> None:
        from openai_harmony import HarmonyError, StreamState

        parser = self._parser
        done_before = len(parser.messages)
        try:
            parser.process(token)
        except HarmonyError:
            self._header.append(token)
            self._leave_harmony(out)
            return
        if parser.state != StreamState.CONTENT:
            self._header.append(token)
            if len(parser.messages) > done_before:
                self._header = []
                self._message_done(parser.messages[-1], out)
            elif len(self._header) > MAX_HEADER_TOKENS:
                self._leave_harmony(out)
            return
        self._header = []
        delta = parser.last_content_delta or ""
        recipient = parser.current_recipient
        if recipient is not None and (self._is_call(recipient) or parser.current_channel != "analysis"):
            self._held.append(delta)
        elif parser.current_channel == "analysis":
            out.reasoning += delta
        else:
            out.content += delta

    def _message_done(self, message: Any, out: ParsedDelta) -> None:
        recipient = message.recipient
        if recipient is None:
            return  # its content has streamed already
        arguments = "".join(self._held)
        self._held = []
        if not self._is_call(recipient):
            out.content += arguments
            return
        out.tool_calls.append(self._tool_call(recipient[len(FUNCTIONS_PREFIX) :], arguments))
        if self._tool_count == self._max_tool_calls:
            self._done = True

    def _is_call(self, recipient: str) -> bool:
        return self._tools and recipient.startswith(FUNCTIONS_PREFIX)

    def _tool_call(self, name: str, arguments: str) -> dict[str, Any]:
        try:
            arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
        except ValueError:
            pass  # passed on as the model wrote it: OpenAI's arguments are a string
        index, self._tool_count = self._tool_count, self._tool_count + 1
        return {
            "index": index,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _leave_harmony(self, out: ParsedDelta) -> None:
        """Pass on what is held (an open header's text, an unfinished call) as content."""
        out.content += "".join(self._held) + (self._decode(self._header) if self._header else "")
        self._held, self._header, self._raw = [], [], True
