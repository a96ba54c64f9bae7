"""The renderer's core: a validated chat request -> prompt token ids + generation params.

This is the work disaggregated decode avoids repeating: chat template rendering and
tokenization of the whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.protocol import ChatRequest, GenerationParams


@dataclass(frozen=True)
class RenderedPrompt:
    prompt_token_ids: list[int]
    params: GenerationParams


class ChatRenderer:
    """Chat template + tokenizer of one model directory."""

    def __init__(self, model_dir: Path, served_name: str):
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not self.tokenizer.chat_template:
            raise ModelUnavailable(f"the tokenizer in {model_dir} has no chat template")
        self.context_length = int(AutoConfig.from_pretrained(model_dir).max_position_embeddings)
        self.served_name = served_name
        # Templates that never mention tools would drop them silently; refuse instead.
        self.supports_tools = "tools" in self.tokenizer.chat_template

    def render(self, request: ChatRequest) -> RenderedPrompt:
        if request.tools and not self.supports_tools:
            raise InvalidRequest(f"the chat template of '{self.served_name}' does not support tools")
        ids = self.token_ids(request)
        return RenderedPrompt(ids, request.generation_params(len(ids), self.context_length, self.served_name))

    def token_ids(self, request: ChatRequest) -> list[int]:
        """Apply the chat template and tokenize, as prefill and the reference both need."""
        if request.continue_final_message and request.messages[-1]["role"] != "assistant":
            raise InvalidRequest("continue_final_message needs the last message to be from the assistant")
        try:
            ids = self.tokenizer.apply_chat_template(
                request.messages,
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                tokenize=True,
                return_dict=False,
                **request.chat_template_kwargs,
            )
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}") from exc
        except TypeError as exc:
            raise InvalidRequest(f"chat_template_kwargs do not fit the template call: {exc}") from exc
        if not ids:
            raise InvalidRequest("the conversation rendered to an empty prompt")
        return [int(i) for i in ids]
