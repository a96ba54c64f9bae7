"""vLLM's `POST /tokenize` and `POST /detokenize`: their bodies validated, their answers made.

Where the ids come from (the contract a test over real servers checks): a chat body
(`messages`) is tokenized by the renderer model of a server, by the very `render()` a chat
completion goes through (`PromptRenderer.render`, same template, tokenizer, render
defaults and checks, the `model` name included), from the ChatRequest that a chat
completion with the same fields parses into. So its ids equal the prompt ids `chat`
computes for that conversation, which prefill gets: rendering it anywhere else (the
router has no tokenizer, and a copy of the template could drift from the server's
config) would only promise that. A `prompt` string is the tokenizer's `encode`, a
detokenize its `decode` of the same renderer. The router and `pdchat openai` parse the
bodies here too (no tokenizer needed), so a bad one is refused before any server call.

Fields (vLLM's request and response shapes); any other is refused by name, as chat does:
- tokenize, chat form: `messages`, `tools`, `add_generation_prompt`, `continue_final_message`,
  `chat_template_kwargs`, `reasoning_effort` (each as chat takes it), `add_special_tokens`
  (false only: the template writes the special tokens), `return_token_strs`, `model`;
- tokenize, prompt form: `prompt`, `add_special_tokens` (default true), `return_token_strs`, `model`;
- answer: `{"count", "max_model_len", "tokens"}`, and `"token_strs"` when asked;
- detokenize: `{"tokens": [ids], "model"}` -> `{"prompt": text}` (special tokens kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdchat.core.errors import InvalidRequest
from pdchat.core.request.protocol import ChatRequest, chat_request_from_body, check_served_model

# The chat-completion fields a chat tokenize takes: every one a render reads.
CHAT_RENDER_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "reasoning_effort",
)
TOKENIZE_CHAT_FIELDS = frozenset({*CHAT_RENDER_FIELDS, "model", "add_special_tokens", "return_token_strs"})
TOKENIZE_PROMPT_FIELDS = frozenset({"prompt", "model", "add_special_tokens", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"tokens", "model"})


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated /tokenize body: a chat (`chat`, rendered) or a plain `prompt` (encoded)."""

    chat: ChatRequest | None = None
    prompt: str | None = None
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


@dataclass(frozen=True)
class DetokenizeRequest:
    tokens: tuple[int, ...]
    model: str | None = None


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """A /tokenize body, validated (InvalidRequest naming what is wrong)."""
    if "messages" in body:
        _known("tokenize (chat form)", body, TOKENIZE_CHAT_FIELDS)
        if _flag(body, "add_special_tokens", False):
            raise InvalidRequest(
                "'add_special_tokens' can only be false with 'messages': the chat template writes the special tokens"
            )
        chat = chat_request_from_body({key: body[key] for key in CHAT_RENDER_FIELDS if key in body})
        return TokenizeRequest(
            chat=chat,
            model=_model(body),
            add_special_tokens=False,
            return_token_strs=_flag(body, "return_token_strs", False),
        )
    if "prompt" not in body:
        raise InvalidRequest("a tokenize request takes 'messages' (a chat) or 'prompt' (a string)")
    _known("tokenize (prompt form)", body, TOKENIZE_PROMPT_FIELDS)
    if not isinstance(body["prompt"], str):
        raise InvalidRequest(f"'prompt' must be a string, got {type(body['prompt']).__name__}")
    return TokenizeRequest(
        prompt=body["prompt"],
        model=_model(body),
        add_special_tokens=_flag(body, "add_special_tokens", True),
        return_token_strs=_flag(body, "return_token_strs", False),
    )


def parse_detokenize(body: dict[str, Any]) -> DetokenizeRequest:
    """A /detokenize body, validated."""
    _known("detokenize", body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise InvalidRequest("'tokens' must be a list of token ids (non-negative integers)")
    return DetokenizeRequest(tuple(tokens), _model(body))


def tokenize(renderer: Any, request: TokenizeRequest) -> dict[str, Any]:
    """vLLM's tokenize answer, from `renderer` (a core.request.rendering.PromptRenderer).
    A chat goes through `renderer.render`, as a chat completion does (its `model` checked there)."""
    if request.chat is not None:
        chat = request.chat if request.model is None else replace(request.chat, model=request.model)
        ids = list(renderer.render(chat).prompt_token_ids)
    else:
        check_served_model(request.model, renderer.served_names)
        renderer.check_chars(len(request.prompt), "the prompt holds")  # as a completion's prompt is
        ids = list(renderer.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": renderer.context_length, "tokens": ids}
    if request.return_token_strs:
        answer["token_strs"] = renderer.tokenizer.convert_ids_to_tokens(ids)
    return answer


def detokenize(renderer: Any, request: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's detokenize answer: the ids' text, special tokens kept (vLLM's default)."""
    check_served_model(request.model, renderer.served_names)
    if len(request.tokens) > renderer.context_length:
        raise InvalidRequest(
            f"'tokens' holds {len(request.tokens)} ids; no text over this model's context of "
            f"{renderer.context_length} tokens is detokenized"
        )
    renderer.check_vocabulary("tokens", request.tokens)
    return {"prompt": renderer.tokenizer.decode(list(request.tokens))}


def _known(what: str, body: dict[str, Any], fields: frozenset[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {', '.join(unknown)} ({what} takes {', '.join(sorted(fields))})"
        )


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be a boolean, got {type(value).__name__}")
    return value


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {type(model).__name__}")
    return model
