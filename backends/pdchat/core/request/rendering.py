"""The renderer's core: a validated chat request -> prompt token ids + generation params.

This is the work disaggregated decode avoids repeating: chat template rendering and
tokenization of the whole conversation.

The chat template belongs to the server. `chat_template_kwargs` may add small template
variables (`enable_thinking`), not replace the template or steer `apply_chat_template`,
unless the operator allows request templates. transformers renders every template,
the model's or a request's, in its sandboxed Jinja environment
(`ImmutableSandboxedEnvironment`, transformers.utils.chat_template_utils); on top of that
each render here is bounded in time and in output size, so one request cannot hold the
renderer or flood the tokenizer.
"""

from __future__ import annotations

import inspect
import json
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.request.protocol import ChatRequest, GenerationParams, reasoning_of, served_names
from pdchat.core.settings import RENDER_TIMEOUT_S

REQUEST_TEMPLATE = "chat_template"
# chat_template_kwargs: template variables, so a few JSON scalars or short lists of them.
MAX_TEMPLATE_KWARGS = 32
MAX_KWARG_BYTES = 4096
MAX_KWARG_ITEMS = 64
# A request's own template, where allowed, may be as long as real models' templates are.
MAX_REQUEST_TEMPLATE_BYTES = 64 * 1024
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class RenderedPrompt:
    prompt_token_ids: list[int]
    params: GenerationParams


# Characters per token a prompt may average before it is refused unread (16x the usual).
MAX_CHARS_PER_TOKEN = 16


class PromptRenderer:
    """What every render format shares: the model's tokenizer, context and vocabulary, the
    early size bound, and `render()` = prompt ids + the generation params they bound."""

    def __init__(self, model_dir: Path, served_name: str | Sequence[str]):
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        self.context_length = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)  # the logits' width: bounds logit_bias and stop_token_ids
        self.served_names = served_names(served_name)  # a request may name any; the first is reported
        self.served_name = self.served_names[0]
        # Refused untokenized: text longer than the context times MAX_CHARS_PER_TOKEN. Real
        # prompts average 3-5 characters a token; the bound keeps a hostile body from costing
        # seconds of tokenizer time (which no alarm can interrupt) on the renderer's one lane.
        self.max_prompt_chars = self.context_length * MAX_CHARS_PER_TOKEN

    def check_size(self, request: ChatRequest) -> int:
        """Refuse, before any template or tokenizer work, a request whose rendered text cannot
        fit the context: every field a render writes counts (contents, reasoning, tool calls,
        tools). Returns the characters counted."""
        chars = sum(len(text) for text in rendered_texts(request))
        self.check_chars(chars, "the messages and tools hold" if request.prompt is None else "the prompt holds")
        return chars

    def check_chars(self, chars: int, what: str) -> None:
        """Refuse `chars` characters of text to tokenize (`what` holds them) that cannot fit
        the context, before the tokenizer sees them: the bound on every route that tokenizes."""
        if chars > self.max_prompt_chars:
            raise InvalidRequest(
                f"{what} {chars} characters; no prompt over {self.max_prompt_chars} "
                f"fits this model's context of {self.context_length} tokens"
            )

    def render(self, request: ChatRequest) -> RenderedPrompt:
        self.check_size(request)
        ids = self.token_ids(request) if request.prompt is None else self.completion_ids(request.prompt)
        return RenderedPrompt(
            ids, request.generation_params(len(ids), self.context_length, self.vocab_size, self.served_names)
        )

    def token_ids(self, request: ChatRequest) -> list[int]:
        raise NotImplementedError

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt's ids, no chat template: a string encoded as vLLM's completions
        encode it (the tokenizer's special tokens added), token ids taken as they are once
        each is in the vocabulary (their length against the context is render()'s check)."""
        if isinstance(prompt, str):
            return [int(i) for i in self.tokenizer.encode(prompt, add_special_tokens=True)]
        self.check_vocabulary("prompt", prompt)
        return list(prompt)

    def check_vocabulary(self, key: str, ids: Sequence[int]) -> None:
        """Refuse ids the tokenizer does not know (InvalidRequest naming `key`)."""
        outside = [i for i in ids if i >= len(self.tokenizer)]
        if outside:
            raise InvalidRequest(f"'{key}' holds ids outside this model's vocabulary: {outside[:5]}")

    def render_defaults(self) -> dict[str, Any]:
        """Render inputs the server supplies (not the request) as of now: part of the gate's
        fingerprint, so a prefill server rendering with other defaults is not trusted."""
        return {}


class ChatRenderer(PromptRenderer):
    """Chat template + tokenizer of one model directory."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str | Sequence[str],
        *,
        allow_request_templates: bool = False,
        render_timeout_s: float = RENDER_TIMEOUT_S.default_value,
    ):
        super().__init__(model_dir, served_name)
        if not self.tokenizer.chat_template:
            raise ModelUnavailable(f"the tokenizer in {model_dir} has no chat template")
        # Templates that never mention tools would drop them silently; refuse instead.
        self.supports_tools = "tools" in self.tokenizer.chat_template
        self.supports_reasoning_effort = "reasoning_effort" in self.tokenizer.chat_template
        self.allow_request_templates = allow_request_templates
        self.render_timeout_s = render_timeout_s
        self.reserved_kwargs = reserved_template_kwargs(self.tokenizer)

    def token_ids(self, request: ChatRequest) -> list[int]:
        """Apply the chat template and tokenize, as prefill and the reference both need."""
        if request.tools and not self.supports_tools:
            raise InvalidRequest(f"the chat template of '{self.served_name}' does not support tools")
        if request.continue_final_message and request.messages[-1]["role"] != "assistant":
            raise InvalidRequest("continue_final_message needs the last message to be from the assistant")
        kwargs = self.template_kwargs(request.chat_template_kwargs)
        if request.reasoning_effort is not None:
            if not self.supports_reasoning_effort:
                raise InvalidRequest(f"'reasoning_effort' is not used by the chat template of '{self.served_name}'")
            kwargs = {**kwargs, "reasoning_effort": request.reasoning_effort}
        text = self._render_text(request, kwargs)
        if len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"the chat template rendered {len(text)} characters; no prompt over {self.max_prompt_chars} "
                f"fits this model's context of {self.context_length} tokens"
            )
        # What apply_chat_template(tokenize=True) does with the text it renders.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InvalidRequest("the conversation rendered to an empty prompt")
        return [int(i) for i in ids]

    def template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's chat_template_kwargs, once each is a variable the template may be given."""
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise InvalidRequest(
                f"chat_template_kwargs has {len(kwargs)} keys; at most {MAX_TEMPLATE_KWARGS} are accepted"
            )
        for key, value in kwargs.items():
            self._check_key(key)
            _check_value(key, value)
        return kwargs

    def _check_key(self, key: str) -> None:
        if key == REQUEST_TEMPLATE and not self.allow_request_templates:
            raise InvalidRequest(
                f"chat_template_kwargs may not set '{key}': this server renders with the model's own chat template"
            )
        if key != REQUEST_TEMPLATE and key in self.reserved_kwargs:
            raise InvalidRequest(
                f"chat_template_kwargs may not set '{key}': the renderer sets it, it is not a template variable"
            )

    def _render_text(self, request: ChatRequest, kwargs: dict[str, Any]) -> str:
        try:
            with _time_bound(self.render_timeout_s):
                return self.tokenizer.apply_chat_template(
                    request.messages,
                    tools=request.tools,
                    add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                    continue_final_message=request.continue_final_message,
                    tokenize=False,
                    **kwargs,
                )
        except _RenderTimedOut:
            raise InvalidRequest(
                f"the chat template took longer than {self.render_timeout_s:g} s to render this request; "
                "the server bounds each render (render_timeout_s)"
            ) from None
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}") from exc
        except TypeError as exc:
            raise InvalidRequest(f"chat_template_kwargs do not fit the template call: {exc}") from exc


def rendered_texts(request: ChatRequest) -> Iterator[str]:
    """The text of every request field a render writes into the prompt."""
    if isinstance(request.prompt, str):
        yield request.prompt
    for message in request.messages:
        yield message["content"]
        yield reasoning_of(message)
        for call in message.get("tool_calls") or []:
            yield json.dumps(call["function"], ensure_ascii=False)
    if request.tools:
        yield json.dumps(request.tools, ensure_ascii=False)


def reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    """Names chat_template_kwargs may not use: the arguments of apply_chat_template and of
    render_jinja_template (they steer the call or clash with it), `messages` (the conversation
    itself) and the special tokens the tokenizer hands the template (bos_token, ...).

    Read from the signatures, so an argument a newer transformers adds is reserved too.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    named = {
        parameter.name
        for function in (type(tokenizer).apply_chat_template, render_jinja_template)
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    return frozenset(named | {"messages"} | set(tokenizer.special_tokens_map))


def _check_value(key: str, value: Any) -> None:
    """A JSON scalar or a short list of them: what a template variable needs, nothing that
    makes a template loop long or render much (a nested object, a huge string)."""
    if key == REQUEST_TEMPLATE and not isinstance(value, (str, type(None))):
        raise InvalidRequest(f"chat_template_kwargs['{key}'] must be a string, got {type(value).__name__}")
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_KWARG_ITEMS:
        raise InvalidRequest(
            f"chat_template_kwargs['{key}'] has {len(items)} items; at most {MAX_KWARG_ITEMS} are accepted"
        )
    max_bytes = MAX_REQUEST_TEMPLATE_BYTES if key == REQUEST_TEMPLATE else MAX_KWARG_BYTES
    for item in items:
        if not isinstance(item, _SCALARS):
            raise InvalidRequest(
                f"chat_template_kwargs['{key}'] must be a string, number, boolean, null or a list of at most "
                f"{MAX_KWARG_ITEMS} of those, got {type(item).__name__}"
            )
        if isinstance(item, str) and len(item.encode("utf-8", "surrogatepass")) > max_bytes:
            raise InvalidRequest(f"chat_template_kwargs['{key}'] is longer than {max_bytes} bytes")


class _RenderTimedOut(BaseException):
    """Raised by SIGALRM inside a render. Not an Exception, so that no `except Exception`
    in Jinja or transformers between the handler and the renderer can swallow it."""


def _expire(signum: int, frame: Any) -> None:
    raise _RenderTimedOut


@contextmanager
def _time_bound(seconds: float) -> Iterator[None]:
    """Raise _RenderTimedOut in the block once `seconds` pass (SIGALRM), then restore the
    previous SIGALRM handler and timer.

    Python runs signal handlers on the main thread only, between bytecodes: this interrupts
    Jinja's compiled Python (loops included, with or without calls) but not one long C call,
    which it interrupts right after. The python backend stub calls execute() on its main
    thread; elsewhere (another thread, or a SIGALRM handler installed outside Python, which
    could not be restored) the block runs without a bound.
    """
    previous_handler = signal.getsignal(signal.SIGALRM)
    if threading.current_thread() is not threading.main_thread() or previous_handler is None:
        yield
        return
    signal.signal(signal.SIGALRM, _expire)
    started = time.monotonic()
    previous_delay, previous_interval = 0.0, 0.0
    try:
        previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous_handler)
            if previous_delay:
                remaining = previous_delay - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-6), previous_interval)
