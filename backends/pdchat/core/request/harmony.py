"""The Harmony render path (GPT-OSS): an OpenAI chat request -> a Harmony conversation -> ids.

openai-harmony renders; this module only maps the request onto its conversation, the way
vLLM's GPT-OSS serving does:

- a system message: reasoning effort (`reasoning_effort`, default medium), the knowledge
  cutoff and the conversation's date (`chat_template_kwargs.current_date`, else the
  server's `current_date` setting, else today in UTC);
- a developer message when there is anything to say: the request's system and developer
  messages as instructions (joined by a blank line, in order) and `tools` as the
  `functions` namespace;
- user turns; assistant turns as `analysis` (their `reasoning_content`), `final` (their
  content) and one `commentary` message per tool call, addressed to `functions.<name>`
  with JSON arguments; tool results as messages from `functions.<name>` (the name found
  through `tool_call_id`, or the message's `name`).

Harmony drops earlier turns' reasoning itself (render_conversation_for_completion).
There is no template here for a request to change, so `chat_template_kwargs` takes only
`current_date`, and forced tool calls and response formats are refused at the stages
(core.generation.generation), where both the render and the reuse paths pass.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdchat.core.errors import InvalidRequest
from pdchat.core.request.harmony_vocab import FUNCTIONS, harmony_encoding
from pdchat.core.request.protocol import ChatRequest, reasoning_of
from pdchat.core.request.rendering import PromptRenderer, rendered_texts

DEFAULT_REASONING_EFFORT = "medium"
CURRENT_DATE = "current_date"
# NOTE: openai-harmony's BPE takes time quadratic in the length of one pre-token piece (a run
# of letters, of whitespace...) and holds the GIL, so no alarm bounds it: longer pieces are
# refused (docs/security.md, "Render cost bounds").
MAX_PIECE_CHARS = 4096
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


class HarmonyRenderer(PromptRenderer):
    """Harmony conversations rendered by openai-harmony, tokens from its o200k_harmony encoding."""

    def __init__(self, model_dir: Path, served_name: str | Sequence[str], *, current_date: str | None = None):
        super().__init__(model_dir, served_name)
        self.encoding = harmony_encoding()
        self.current_date = _checked_date("the current_date setting", current_date) if current_date else None

    def render_defaults(self) -> dict[str, Any]:
        return {"format": "harmony", CURRENT_DATE: self._server_date()}

    def token_ids(self, request: ChatRequest) -> list[int]:
        from openai_harmony import Role

        if request.continue_final_message:
            raise InvalidRequest("continue_final_message is not supported by the Harmony format (GPT-OSS)")
        self._check_pieces(request)
        conversation = self.conversation(request)
        if request.add_generation_prompt:
            ids = self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        else:
            ids = self.encoding.render_conversation(conversation)
        return [int(i) for i in ids]

    def _check_pieces(self, request: ChatRequest) -> None:
        """Refuse text Harmony's tokenizer would take seconds on, found by the (linear) fast
        tokenizer's pre-tokenizer, which splits text as o200k does."""
        split = self.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
        for text in rendered_texts(request):
            longest = max((end - start for _, (start, end) in split(text)), default=0)
            if longest > MAX_PIECE_CHARS:
                raise InvalidRequest(
                    f"the request holds a run of {longest} characters that tokenizes as one piece "
                    f"(letters or whitespace without a break); at most {MAX_PIECE_CHARS} are accepted "
                    "with the Harmony format"
                )

    def conversation(self, request: ChatRequest) -> Any:
        """The request as openai-harmony's Conversation (what its renderer takes)."""
        from openai_harmony import Conversation, Message, Role

        messages = [Message.from_role_and_content(Role.SYSTEM, self._system(request))]
        developer = self._developer(request)
        if developer is not None:
            messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        tool_names: dict[str, str] = {}
        for index, message in enumerate(request.messages):
            messages += self._turn(index, message, tool_names)
        return Conversation.from_messages(messages)

    def _system(self, request: ChatRequest) -> Any:
        from openai_harmony import ReasoningEffort, SystemContent

        effort = request.reasoning_effort or DEFAULT_REASONING_EFFORT
        return (
            SystemContent.new()
            .with_reasoning_effort(ReasoningEffort(effort.capitalize()))
            .with_conversation_start_date(self._date(request.chat_template_kwargs))
        )

    def _date(self, kwargs: dict[str, Any]) -> str:
        unknown = sorted(set(kwargs) - {CURRENT_DATE})
        if unknown:
            raise InvalidRequest(
                f"chat_template_kwargs may only set '{CURRENT_DATE}' with the Harmony format (GPT-OSS), "
                f"got {', '.join(unknown)}"
            )
        if CURRENT_DATE in kwargs:
            return _checked_date(f"chat_template_kwargs['{CURRENT_DATE}']", kwargs[CURRENT_DATE])
        return self._server_date()

    def _server_date(self) -> str:
        return self.current_date or time.strftime("%Y-%m-%d", time.gmtime())

    def _developer(self, request: ChatRequest) -> Any | None:
        from openai_harmony import DeveloperContent, ToolDescription

        instructions = "\n\n".join(m["content"] for m in request.messages if m["role"] in ("system", "developer"))
        tools = [t["function"] for t in request.tools or []] if request.tool_choice != "none" else []
        if not instructions and not tools:
            return None
        content = DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        if tools:
            content = content.with_function_tools(
                [ToolDescription.new(t["name"], t.get("description", ""), t.get("parameters")) for t in tools]
            )
        return content

    def _turn(self, index: int, message: dict[str, Any], tool_names: dict[str, str]) -> list[Any]:
        from openai_harmony import Author, Message, Role

        role, content = message["role"], message["content"]
        if role in ("system", "developer"):
            return []  # folded into the developer message's instructions
        if role == "user":
            return [Message.from_role_and_content(Role.USER, content)]
        if role == "tool":
            name = tool_names.get(message.get("tool_call_id", "")) or message.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(
                    f"messages[{index}] is a tool result whose tool_call_id names no earlier tool call "
                    "(and it has no 'name'): Harmony addresses results by function name"
                )
            return [
                Message.from_author_and_content(Author.new(Role.TOOL, f"{FUNCTIONS}.{name}"), content)
                .with_channel("commentary")
                .with_recipient("assistant")
            ]
        turn = []
        reasoning = reasoning_of(message)
        if reasoning:
            turn.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
        if content:
            turn.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            if isinstance(call.get("id"), str):
                tool_names[call["id"]] = name
            arguments = json.dumps(call["function"]["arguments"], ensure_ascii=False)
            turn.append(
                Message.from_role_and_content(Role.ASSISTANT, arguments)
                .with_channel("commentary")
                .with_recipient(f"{FUNCTIONS}.{name}")
                .with_content_type("<|constrain|>json")
            )
        return turn


def _checked_date(where: str, value: Any) -> str:
    try:
        if not isinstance(value, str) or not _DATE.fullmatch(value):
            raise ValueError
        datetime.date.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"{where} must be a date as YYYY-MM-DD, got {value!r}") from None
    return value
