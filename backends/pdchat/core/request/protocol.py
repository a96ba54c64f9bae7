"""Typed chat requests: parse and validate what clients send, before any work.

Three front doors lead to the same `ChatRequest`: an OpenAI chat-completions body
(`request` JSON), an OpenAI completions body (`completion_request` JSON: a raw `prompt`,
text or token ids, that no chat template renders) and the TensorRT-LLM/genai-perf
`text_input` convention. Every refusal is an `InvalidRequest` naming the field and what
is accepted.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from pdchat.core.errors import InvalidRequest, ModelNotFound
from pdchat.core.request.grammar import (
    check_limits,
    check_spec,
    known_keys,
    response_format_spec,
    tool_choice_spec,
)
from pdchat.core.settings import grammar_limits

ROLES = ("system", "developer", "user", "assistant", "tool")
# The keys a message may carry, and the roles each is taken on (role and content: all).
MESSAGE_KEYS = {
    "role": ROLES,
    "content": ROLES,
    "tool_calls": ("assistant",),
    "reasoning_content": ("assistant",),
    "reasoning": ("assistant",),  # vLLM's name for reasoning_content
    "tool_call_id": ("tool",),
    "name": ("tool",),
}
# OpenAI's message keys that no render here writes: taken when null, as a client sending back
# an earlier response's message may set them; refused otherwise, with what to send instead.
NULL_ONLY_MESSAGE_KEYS = {
    "refusal": "send the refusal's text as the content",
    "function_call": "send tool_calls (function_call is OpenAI's deprecated form)",
    "audio": "send text content",
}
_MESSAGE_KEYS_TAKEN = ", ".join(
    [key if roles == ROLES else f"{key} ({' or '.join(roles)})" for key, roles in MESSAGE_KEYS.items()]
    + [f"{key} (null only)" for key in NULL_ONLY_MESSAGE_KEYS]
)
# Request fields accepted and ignored, as OpenAI-compatible servers do (they change no output).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
# vLLM/SGLang switches routers such as vllm-router add to every request: honoured at the value
# that is this server's behaviour, refused at any other.
FIXED_FIELDS = {
    "skip_special_tokens": True,
    "include_reasoning": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "no_stop_trim": False,
    "return_hidden_states": False,
}
# The fields chat and completions bodies share: model, limits, sampling, streaming, logprobs
# (a flag for chat, a count for completions) and the token-id wire forms.
SHARED_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "ignore_eos",
        "return_token_ids",
        "kv_transfer_params",
        "prompt_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
        "top_k",
        "min_p",
        "logprobs",
        "cache_salt",
    }
)
# Every other field this server honours in a chat; anything else is refused by name.
HONOURED_FIELDS = SHARED_FIELDS | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "response_format",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "top_logprobs",
    "parallel_tool_calls",
    "reasoning_effort",
}
REASONING_EFFORTS = ("low", "medium", "high")
TOOL_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# OpenAI's bounds: penalties in [-2, 2], biases in [-100, 100], up to 20 alternatives per token.
PENALTY_BOUND = 2.0
LOGIT_BIAS_BOUND = 100.0
MAX_TOP_LOGPROBS = 20
# Decode looks for every stop string in the text held back at each token, in its batch loop:
# 100,000 of them (1.2 MB) cost 13 ms per token per sequence, slowing every request batched beside.
MAX_STOP_STRINGS = 64
# vLLM's GPU model runner fails its whole engine core on a request over these (logit_bias
# entries; stop_token_ids with min_tokens): refused here, on either engine.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_STOP_TOKEN_IDS = 128
# The completions API (/v1/completions): the shared fields plus its own; anything else is refused by name.
COMPLETION_FIELDS = SHARED_FIELDS | {"prompt", "echo"}
# OpenAI completions fields this server does not do, refused by name (unless null) with why.
UNSUPPORTED_COMPLETION_FIELDS = {
    "suffix": "text after the insertion point (fill-in-the-middle) is not supported; send the prompt only",
    "best_of": "no choice is picked from more samples; leave it out",
}
# Fields whose JSON form is a list but whose value is a tuple (frozen, comparable).
_TUPLE_FIELDS = ("stop", "stop_token_ids")
# Generous but finite: the default when a request names no max_tokens.
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """What a client asks of generation that passes unchanged from request to params."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    return_token_ids: bool = False
    # Prepended to the non-streamed text_output (text_input with exclude_input_in_output false).
    echo_text: str = ""
    # Grammar the output must follow (core.request.grammar spec).
    constraint: dict[str, Any] | None = None
    # stream_options.include_usage: a last chunk with empty choices and the usage.
    include_usage: bool = False
    # Per request, inside the batched engine (core.generation.sampling.LogitsShaper):
    # OpenAI's presence/frequency penalties over the output so far, vLLM's repetition
    # penalty over prompt + output, biases by token id (decimal string keys, OpenAI's form).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = field(default_factory=dict)
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    # EOS and stop_token_ids are suppressed until min_tokens tokens are out.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # Raw log-probabilities of each output token, and of its top_logprobs alternatives.
    logprobs: bool = False
    top_logprobs: int = 0
    # False: the answer ends with its first complete tool call.
    parallel_tool_calls: bool = True
    # vLLM's field: prompts share cached KV blocks only with requests of the same salt.
    cache_salt: str | None = None
    # The completions API: the answer is `text_completion` shaped (raw text, its logprobs in
    # that API's shape); `echo` writes the prompt (its ids decoded) before the text.
    completion: bool = False
    echo: bool = False

    def sampling_options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(SamplingOptions)}

    def check_controls(self, vocab_size: int, max_tokens: int | None) -> None:
        """Refuse penalties, biases, limits and logprobs out of range (the very checks a body
        gets), token ids outside the vocabulary, and min_tokens above max_tokens."""
        _sampling_controls(self.sampling_options())
        for key, ids in (("logit_bias", [int(k) for k in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            outside = [i for i in ids if i >= vocab_size]
            if outside:
                raise InvalidRequest(
                    f"'{key}' names token ids outside this model's vocabulary of {vocab_size}: {outside[:5]}"
                )
        _min_tokens_fit(self.min_tokens, max_tokens)


class _WireForm:
    """JSON across process boundaries for the frozen dataclasses below. from_json does not
    validate again: what crosses is sealed, or checked where it is used (params.check())."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str):
        try:
            return cls(**_tuples(json.loads(text)))
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"not valid {cls.__name__} JSON: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class GenerationParams(SamplingOptions, _WireForm):
    """Everything prefill and decode need beyond the prompt ids; travels as JSON."""

    max_tokens: int
    seed: int = 0
    parse_tool_calls: bool = False
    request_id: str = ""
    model: str = ""
    created: int = 0

    def check(self, prompt_tokens: int, context_length: int, vocab_size: int) -> None:
        """What a stage model verifies before any work, whoever sent the params."""
        _number("temperature", self.temperature, 0.0, 0.0, 2.0)
        _number("top_p", self.top_p, 0.0, 1e-6, 1.0)
        _positive_int("max_tokens", self.max_tokens)
        _seed(self.seed)
        self.check_controls(vocab_size, self.max_tokens)
        if prompt_tokens + self.max_tokens > context_length:
            raise InvalidRequest(
                f"{prompt_tokens} prompt tokens + max_tokens={self.max_tokens} exceed this model's context of "
                f"{context_length} tokens"
            )


@dataclass(frozen=True, kw_only=True)
class ChatRequest(SamplingOptions, _WireForm):
    """A validated chat request: the render inputs plus the sampling wishes. Its JSON is the
    canonical form `chat` hands the renderer, parsed and validated once. A completions
    request is one too: `prompt` set (text, or token ids taken as the rendered prompt), no
    messages, `completion` true; every stage and the gate treat it as a chat."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    # The completions API's prompt: a string (tokenized without a chat template) or token ids.
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's reasoning_effort (low | medium | high): a render input (Harmony's system message).
    reasoning_effort: str | None = None
    model: str | None = None
    max_tokens: int | None = None
    seed: int | None = None
    # vLLM's wire form: kv_transfer_params inside the body, taken like the tensor of that name.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's newer wire form (#55771): forwarded ids at the top level, taken like the tensor
    # (the gate admits them only signed, as any forwarded ids).
    prompt_token_ids: list[int] | None = None

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def generation_params(
        self, prompt_tokens: int, context_length: int, vocab_size: int, served_model: str | Sequence[str]
    ) -> GenerationParams:
        """Freeze the sampling side once the prompt's length is known (it bounds max_tokens)
        and the vocabulary (it bounds logit_bias and stop_token_ids). `served_model`: the
        served name or names (ModelNotFound for a request naming another); the first is
        what the answer reports."""
        names = served_names(served_model)
        check_served_model(self.model, names)
        max_tokens = resolve_max_tokens(self.max_tokens, prompt_tokens, context_length, at_least=self.min_tokens)
        self.check_controls(vocab_size, max_tokens)
        return GenerationParams(
            **self.sampling_options(),
            max_tokens=max_tokens,
            # A random seed chosen once here keeps prefill and decode on one sample path.
            seed=self.seed if self.seed is not None else secrets.randbits(63),
            parse_tool_calls=self.parse_tool_calls,
            request_id=f"{'cmpl' if self.completion else 'chatcmpl'}-{uuid.uuid4().hex}",
            model=names[0],
            created=int(time.time()),
        )


def served_names(served: str | Sequence[str]) -> tuple[str, ...]:
    """One served name, or several (setting SERVED_MODEL_NAME), as a non-empty tuple."""
    names = (served,) if isinstance(served, str) else tuple(served)
    if not names:
        raise ValueError("a server serves at least one model name")
    return names


def check_served_model(model: str | None, served: str | Sequence[str]) -> None:
    """Refuse a request whose `model` names none of the served names (ModelNotFound: HTTP
    404 `model_not_found`, as OpenAI and vLLM answer); no name or an empty one is taken."""
    names = served_names(served)
    if model not in (None, "", *names):
        listed = ", ".join(f"'{name}'" for name in names)
        raise ModelNotFound(f"model '{model}' is not served here; this server serves {listed}")


def json_object(name: str, text: str | bytes) -> dict[str, Any]:
    """`text` (the `name` input) as a JSON object, else InvalidRequest. orjson: several times
    faster than json on long conversations, and it refuses what no stage could use (lone
    UTF-16 surrogates, NaN, infinities, nesting past 1024) as invalid JSON, not as a crash."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"'{name}' is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"'{name}' must be a JSON object, got {type(body).__name__}")
    return body


def parse_chat_json(body: str | bytes) -> ChatRequest:
    """Parse an OpenAI chat-completions body (the `request` input) into a ChatRequest."""
    return chat_request_from_body(json_object("request", body))


def utf8_json(data: dict[str, Any]) -> bytes:
    """The body as UTF-8 JSON; refuses a lone UTF-16 surrogate, which no stage can encode."""
    try:
        return json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"'request' holds a lone UTF-16 surrogate ({exc.object[exc.start : exc.end]!r}), "
            "which is not text; send valid Unicode"
        ) from None


def chat_request_from_body(data: dict[str, Any], *, check_grammar: bool = True) -> ChatRequest:
    """Validate an already parsed OpenAI chat-completions body (the router parsed it once).
    `check_grammar=False` leaves schemas to the servers: xgrammar imports torch, which the
    router does without."""
    _known_fields(data, HONOURED_FIELDS, "this server honours")
    _single_choice(data.get("n"))
    # max_completion_tokens is OpenAI's newer name: it wins where both are given, as in vLLM.
    max_tokens = _positive_int("max_tokens", data.get("max_tokens"))
    max_tokens = _positive_int("max_completion_tokens", data.get("max_completion_tokens")) or max_tokens
    tools = _tools(data.get("tools"))
    tool_choice = data.get("tool_choice")
    _strict_tools_fit(tools, tool_choice)
    return ChatRequest(
        messages=_messages(data.get("messages")),
        tools=tools,
        tool_choice=tool_choice,
        constraint=_constraint(tool_choice, tools, data.get("response_format"), check_grammar),
        chat_template_kwargs=_typed(data, "chat_template_kwargs", dict, {}),
        add_generation_prompt=_typed(data, "add_generation_prompt", bool, True),
        continue_final_message=_typed(data, "continue_final_message", bool, False),
        reasoning_effort=_reasoning_effort(data.get("reasoning_effort")),
        **_shared_fields(data, max_tokens),
    )


def parse_completion_json(body: str | bytes) -> ChatRequest:
    """Parse an OpenAI completions body (the `completion_request` input) into a ChatRequest."""
    return completion_request_from_body(json_object("completion_request", body))


def completion_request_from_body(data: dict[str, Any]) -> ChatRequest:
    """Validate an already parsed OpenAI completions body: `prompt` a string or a list of
    token ids (a batch of one taken as its prompt), `echo`, `logprobs` an integer (the
    alternatives per token, 0 for the chosen token's only), the sampling fields chat takes.
    `suffix` and `best_of` are refused by name; so is `echo` with `logprobs`, which would
    need the prompt's logprobs (prefill computes the last position's logits only)."""
    for key, why in UNSUPPORTED_COMPLETION_FIELDS.items():
        if data.get(key) is not None:
            raise InvalidRequest(f"'{key}' is not supported by this server: {why}")
    _known_fields(
        {k: v for k, v in data.items() if k not in UNSUPPORTED_COMPLETION_FIELDS}, COMPLETION_FIELDS, "completions take"
    )
    _single_choice(data.get("n"))
    logprobs = None if data.get("logprobs") is None else _bounded_int("logprobs", data["logprobs"], 0, MAX_TOP_LOGPROBS)
    echo = _typed(data, "echo", bool, False)
    if echo and logprobs is not None:
        raise InvalidRequest(
            "'echo' with 'logprobs' asks for the prompt's logprobs, which this server does not compute; "
            "send one of them"
        )
    sampling = {**data, "logprobs": logprobs is not None, "top_logprobs": logprobs}
    return ChatRequest(
        prompt=_completion_prompt(data.get("prompt")),
        completion=True,
        echo=echo,
        **_shared_fields(sampling, _positive_int("max_tokens", data.get("max_tokens"))),
    )


def _single_choice(n: Any) -> None:
    if n is not None and (type(n) is not int or n != 1):
        raise InvalidRequest(
            f"'n' must be 1, an integer (one choice per request here; the router and pdchat openai serve n > 1 "
            f"as n requests), got {n!r}"
        )


def _known_fields(data: dict[str, Any], honoured: frozenset[str], taken: str) -> None:
    """Refuse the fields outside `honoured` (and the ignored ones) by name, and the fixed
    switches at any value but this server's behaviour."""
    unknown = sorted(set(data) - honoured - IGNORED_FIELDS - set(FIXED_FIELDS))
    for key in sorted(set(data) & set(FIXED_FIELDS)):
        if data[key] is not None and data[key] is not FIXED_FIELDS[key]:  # a bool: 1 is not true
            raise InvalidRequest(
                f"'{key}' can only be {str(FIXED_FIELDS[key]).lower()} on this server, got {data[key]!r}"
            )
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {', '.join(unknown)} ({taken} "
            f"{', '.join(sorted(honoured))}; see docs/client-contract.md)"
        )


def _shared_fields(data: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """What chat and completions bodies share, validated: the model, limits, sampling,
    streaming and the token-id wire forms."""
    controls = _sampling_controls(data)
    _min_tokens_fit(controls["min_tokens"], max_tokens)
    return {
        "model": _typed(data, "model", str, None),
        "max_tokens": max_tokens,
        "temperature": _number("temperature", data.get("temperature"), 1.0, 0.0, 2.0),
        "top_p": _number("top_p", data.get("top_p"), 1.0, 1e-6, 1.0),
        "seed": _seed(data.get("seed")),
        "stop": _stop(data.get("stop")),
        "ignore_eos": _typed(data, "ignore_eos", bool, False),
        "stream": _typed(data, "stream", bool, False),
        "return_token_ids": _typed(data, "return_token_ids", bool, False),
        "include_usage": _include_usage(data.get("stream_options"), data.get("stream")),
        "kv_transfer_params": _typed(data, "kv_transfer_params", dict, None),
        "prompt_token_ids": _typed(data, "prompt_token_ids", list, None),
        **controls,
    }


def _completion_prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(type(i) is int and i >= 0 for i in value):
        return value
    raise InvalidRequest(
        "'prompt' must be a non-empty string or a non-empty list of token ids (non-negative integers); "
        f"one prompt per request, got {type(value).__name__}"
    )


def _sampling_controls(data: dict[str, Any]) -> dict[str, Any]:
    """Penalties, biases, limits and logprobs, validated and normalized: one place for their
    rules, applied to a client's body and again to the params a stage model receives."""
    logprobs = _typed(data, "logprobs", bool, False)
    top_logprobs = _bounded_int("top_logprobs", data.get("top_logprobs"), 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
    return {
        "presence_penalty": _number(
            "presence_penalty", data.get("presence_penalty"), 0.0, -PENALTY_BOUND, PENALTY_BOUND
        ),
        "frequency_penalty": _number(
            "frequency_penalty", data.get("frequency_penalty"), 0.0, -PENALTY_BOUND, PENALTY_BOUND
        ),
        "repetition_penalty": _positive_number("repetition_penalty", data.get("repetition_penalty"), 1.0),
        "logit_bias": _logit_bias(data.get("logit_bias")),
        "top_k": _top_k(data.get("top_k")),
        "min_p": _number("min_p", data.get("min_p"), 0.0, 0.0, 1.0),
        "min_tokens": _bounded_int("min_tokens", data.get("min_tokens"), 0, None),
        "stop_token_ids": _token_ids("stop_token_ids", data.get("stop_token_ids"), MAX_STOP_TOKEN_IDS),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "parallel_tool_calls": _typed(data, "parallel_tool_calls", bool, True),
        "cache_salt": _cache_salt(data.get("cache_salt")),
    }


def _cache_salt(salt: Any) -> str | None:
    if salt is None:
        return None
    if type(salt) is not str or not salt:
        raise InvalidRequest(f"'cache_salt' must be a non-empty string, got {salt!r}")
    return salt


def _min_tokens_fit(min_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})")


def _tuples(values: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back into the tuples the dataclasses hold."""
    return {**values, **{key: tuple(values[key]) for key in _TUPLE_FIELDS if key in values}}


def _include_usage(options: Any, stream: Any) -> bool:
    if options is None:
        return False
    if stream is not True:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("'stream_options' takes only {'include_usage': true|false}")
    return _typed(options, "include_usage", bool, False)


def text_input_request(
    text: str,
    *,
    max_tokens: int | None = None,
    stream: bool = False,
    exclude_input_in_output: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> ChatRequest:
    """The text_input convention: one user message, greedy unless a temperature is given."""
    if not text.strip():
        raise InvalidRequest("'text_input' is empty")
    return ChatRequest(
        messages=[{"role": "user", "content": text}],
        max_tokens=_positive_int("max_tokens", max_tokens),
        temperature=_number("temperature", temperature, 0.0, 0.0, 2.0),
        top_p=_number("top_p", top_p, 1.0, 1e-6, 1.0),
        seed=_seed(seed),
        stream=stream,
        # TensorRT-LLM echoes the prompt only in whole (non-streamed) answers.
        echo_text="" if exclude_input_in_output or stream else text,
    )


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context_length: int, *, at_least: int = 0) -> int:
    """Fit the answer into the context window; refuse what cannot fit. The default leaves
    room for `at_least` tokens (min_tokens) where the context allows."""
    room = context_length - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens, which leaves no room in this model's "
            f"context of {context_length} tokens"
        )
    if requested is None:
        return min(max(DEFAULT_MAX_TOKENS, at_least), room)
    if requested > room:
        raise InvalidRequest(
            f"max_tokens={requested} does not fit: this model's context is {context_length} tokens "
            f"and the prompt takes {prompt_tokens}, leaving {room}"
        )
    return requested


def _constraint(
    tool_choice: Any, tools: list | None, response_format: Any, check_grammar: bool
) -> dict[str, Any] | None:
    """The one grammar the output must follow: a forced tool call or a JSON format."""
    forced_call = tool_choice_spec(tool_choice, tools)
    json_format = response_format_spec(response_format)
    if forced_call and json_format:
        raise InvalidRequest("response_format cannot be combined with tool_choice 'required' or a named function")
    spec = forced_call or json_format
    if spec is not None:
        check_limits(spec, grammar_limits())  # pure Python: every parser refuses an outsize grammar
        if check_grammar:
            check_spec(spec)  # refuse an unusable schema now, before any work
    return spec


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'messages' must be a non-empty list of chat messages")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}")
    known_keys(where, message, [*MESSAGE_KEYS, *NULL_ONLY_MESSAGE_KEYS], _MESSAGE_KEYS_TAKEN)
    for key, instead in NULL_ONLY_MESSAGE_KEYS.items():
        if message.get(key) is not None:
            raise InvalidRequest(f"{where}.{key} is not rendered by this server; {instead}")
    normalized = dict(message)
    normalized["content"] = _content(where, message.get("content"), allow_empty=role == "assistant")
    for key in ("reasoning_content", "reasoning", "tool_call_id", "name"):
        value, allowed = message.get(key), MESSAGE_KEYS[key]
        if value is None:
            continue
        if role not in allowed:
            raise InvalidRequest(f"{where}.{key} is only taken on {' or '.join(allowed)} messages")
        if not isinstance(value, str):
            raise InvalidRequest(f"{where}.{key} must be a string, got {type(value).__name__}")
    if role == "tool" and not message.get("tool_call_id"):
        raise InvalidRequest(f"{where} is a tool result without 'tool_call_id': it must name the tool call it answers")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise InvalidRequest(f"{where}.tool_calls must be a list on an assistant message")
        normalized["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(tool_calls)]
    return normalized


def reasoning_of(message: dict[str, Any]) -> str:
    """An assistant message's earlier reasoning: `reasoning_content`, or vLLM's `reasoning`
    (both checked to be strings by _message)."""
    return message.get("reasoning_content") or message.get("reasoning") or ""


def _content(where: str, content: Any, *, allow_empty: bool) -> str:
    """Flatten text parts into one string, joined by newlines as vLLM's chat utils do (so a
    request tokenizes the same on both); refuse media, which no stage here can read."""
    if content is None and allow_empty:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.content[{j}] has type {kind!r}; only text parts are supported")
            known_keys(f"{where}.content[{j}]", part, ("type", "text"))
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"{where}.content must be a string or a list of text parts")


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or call.get("type") not in (None, "function")
    ):
        raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    known_keys(where, call, ("id", "type", "function"))
    known_keys(f"{where}.function", function, ("name", "arguments"))
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise InvalidRequest(f"{where}.id must be a string, got {type(call['id']).__name__}")
    _function_name(f"{where}.function.name", function["name"])
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant, parse_int=_int64, parse_float=_finite)
        except ValueError as exc:
            raise InvalidRequest(f"{where}.function.arguments is not valid JSON: {exc}") from None
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


# Strict JSON numbers, as the body's parser (orjson) takes them: no NaN or infinities (which
# canonical JSON cannot tell from null), no integers past 64 bits (which it cannot write).
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _int64(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"the integer {text[:40]} does not fit 64 bits")
    return value


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


# OpenAI's rule for function names; it also keeps Harmony's `functions.<name>` recipient unambiguous.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _function_name(where: str, name: str) -> None:
    if not _FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{where} must be 1-64 letters, digits, underscores or dashes, got {name[:80]!r}")


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be a list of {'type': 'function', 'function': {...}}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        known_keys(f"tools[{i}]", tool, ("type", "function"))
        known_keys(f"tools[{i}].function", function, TOOL_FUNCTION_KEYS)
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string")
        _function_name(f"tools[{i}].function.name", function["name"])
        if not isinstance(function.get("description", ""), str):
            raise InvalidRequest(f"tools[{i}].function.description must be a string")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise InvalidRequest(f"tools[{i}].function.strict must be a bool")
    return value or None


def _strict_tools_fit(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """`strict: true` asks for calls that follow the tool's schema: kept where a grammar forces
    the call (tool_choice 'required' or a named function) or no call is made ('none'); under
    'auto' the model writes calls unconstrained, so it is refused rather than not kept."""
    if tool_choice not in (None, "auto"):
        return
    for i, tool in enumerate(tools or []):
        if tool["function"].get("strict") is True:
            raise InvalidRequest(
                f"tools[{i}].function.strict is true, which this server keeps only when tool_choice is 'required' "
                "or names a function (a call then follows its schema); send strict false or such a tool_choice"
            )


def _typed(data: dict, key: str, kind: type, default: Any) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidRequest(f"'{key}' must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _positive_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"'{key}' must be a positive integer, got {value!r}")
    return value


def _number(key: str, value: Any, default: float, low: float, high: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidRequest(f"'{key}' must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _positive_number(key: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidRequest(f"'{key}' must be a number > 0, got {value!r}")
    return float(value)


def _bounded_int(key: str, value: Any, low: int, high: int | None) -> int:
    if value is None:
        return low
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        accepted = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"'{key}' must be an integer {accepted}, got {value!r}")
    return value


def _top_k(value: Any) -> int:
    """-1 and 0 both mean off (vLLM, HF); stored as 0."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidRequest(f"'top_k' must be -1 or 0 (off) or a positive integer, got {value!r}")
    return max(value, 0)


def _logit_bias(value: Any) -> dict[str, float]:
    """{token id as a decimal string: bias in [-100, 100]}, keys normalized ("007" -> "7")."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("'logit_bias' must be an object mapping token ids (as strings) to biases in [-100, 100]")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
    bias = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit():
            raise InvalidRequest(f"'logit_bias' keys must be token ids (non-negative integers as strings), got {key!r}")
        if amount is None:
            raise InvalidRequest(
                f"'logit_bias[{key}]' must be a number in [{-LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got None"
            )
        bias[str(int(key))] = _number(f"logit_bias[{key}]", amount, 0.0, -LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND)
    return bias


def _token_ids(key: str, value: Any, most: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise InvalidRequest(f"'{key}' must be a list of token ids (non-negative integers), got {value!r}")
    if len(value) > most:
        raise InvalidRequest(f"'{key}' has {len(value)} token ids; at most {most} are allowed")
    return tuple(value)


def _reasoning_effort(value: Any) -> str | None:
    if value is not None and value not in REASONING_EFFORTS:
        raise InvalidRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}")
    return value


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"'seed' must be a non-negative integer, got {value!r}")
    return value % (1 << 63)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are taken")
    return tuple(stops)
