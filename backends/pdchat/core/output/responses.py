"""Shape decode's deltas into what clients read: text_output and OpenAI JSON.

Streaming: one output per delta (`chat.completion.chunk`), and with
stream_options.include_usage a last chunk with empty `choices` and the `usage`, as OpenAI
sends it. Not streaming: one output at the end (`chat.completion`). The text is parsed into
content, reasoning_content and tool_calls; text_output keeps the raw text. Token ids also travel as binary tensors. With
`logprobs`, each choice carries OpenAI's `logprobs.content` for its tokens (every token,
stop tokens included, whether or not its text was shown).

A completions request (`GenerationParams.completion`) is answered in that API's shape
(`CompletionAssembler`): `text_completion` objects, streamed or whole, whose choice holds
the raw text, unparsed, the prompt first with `echo`, and logprobs as
tokens/token_logprobs/top_logprobs/text_offset.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from pdchat.core.output.harmony import HarmonyOutputParser
from pdchat.core.output.logprobs import TokenLogprobs, TokenSpeller
from pdchat.core.output.parsing import OutputParser, ParsedDelta
from pdchat.core.request.protocol import GenerationParams

FINISH_TOOL_CALLS = "tool_calls"
# finish_reason of a stream that failed after it started; `response` carries {"error": ...}.
FAILED = "error"


@dataclass(frozen=True)
class Delta:
    """What one decode step adds: one token, its text (maybe empty), maybe the end."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when the request asked
    cached_tokens: int | None = None  # on the first delta: prompt tokens the prefix cache gave


@dataclass(frozen=True)
class ClientOutput:
    """One Triton response's worth of the client contract's outputs."""

    text_output: str
    response: str
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def final(self) -> bool:
        return bool(self.finish_reason)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> ClientOutput:
        return cls(**json.loads(text))


class ResponseAssembler:
    """A chat completion's outputs, delta by delta (`response_assembler` picks the class)."""

    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"

    def __init__(
        self,
        params: GenerationParams,
        prompt_token_ids: list[int],
        parser: OutputParser | HarmonyOutputParser,
        speller: TokenSpeller,
        first_output_sent: bool = False,
    ):
        """`first_output_sent`: the client has this stream's first output already (made from
        the same first delta elsewhere): the first delta returns none, unless it ends the answer."""
        self._params = params
        self._skip_first = first_output_sent
        self._prompt_token_ids = prompt_token_ids
        self._parser = parser
        self._speller = speller
        self._first = True
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._parsed = ParsedDelta()
        self._cached_tokens = 0

    def on_delta(self, delta: Delta) -> list[ClientOutput]:
        """The outputs this delta produces now (none, one, or at the end of a stream that
        asked for usage, two); only the last one of a request carries its finish_reason."""
        if delta.cached_tokens is not None:
            self._cached_tokens = delta.cached_tokens
        self._text.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        self._logprobs.extend(delta.logprobs)
        parsed = self._parse(delta)
        self._parsed.extend(parsed)
        finish = self._finish_reason(delta.finish_reason)
        if self._params.stream:
            chunk = self._chunk(delta, parsed, finish)
            skip, self._skip_first = self._skip_first, False
            if skip and not finish:
                return []
            if finish and self._params.include_usage:
                return [replace(chunk, finish_reason=""), self._usage_chunk(finish)]
            return [chunk]
        return [self._completion(finish)] if finish else []

    def _parse(self, delta: Delta) -> ParsedDelta:
        parsed = self._parser.feed(delta.text, delta.token_ids)
        if delta.finish_reason:
            parsed.extend(self._parser.finish())
        return parsed

    def _finish_reason(self, finish: str | None) -> str:
        if finish == "stop" and self._parsed.tool_calls:
            return FINISH_TOOL_CALLS
        return finish or ""

    def _chunk(self, delta: Delta, parsed: ParsedDelta, finish: str) -> ClientOutput:
        message: dict = {"role": "assistant"} if self._first else {}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.content or not (parsed.reasoning or parsed.tool_calls):
            message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        prompt_ids = self._prompt_token_ids if self._first else []
        choice = {"index": 0, "delta": message, **self._logprobs_field(delta.logprobs), "finish_reason": finish or None}
        body = self._envelope(self.CHUNK_OBJECT, choice, prompt_ids, delta.token_ids)
        self._first = False
        return ClientOutput(delta.text, json.dumps(body, ensure_ascii=False), prompt_ids, delta.token_ids, finish)

    def _usage_chunk(self, finish: str) -> ClientOutput:
        body = {
            "id": self._params.request_id,
            "object": self.CHUNK_OBJECT,
            "created": self._params.created,
            "model": self._params.model,
            "choices": [],
            "usage": self._usage(),
        }
        return ClientOutput("", json.dumps(body, ensure_ascii=False), finish_reason=finish)

    def _completion(self, finish: str, extra: dict[str, Any] | None = None) -> ClientOutput:
        parsed = self._parsed
        message: dict = {
            "role": "assistant",
            "content": parsed.content if parsed.content or not parsed.tool_calls else None,
        }
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in parsed.tool_calls]
        choice = {"index": 0, "message": message, **self._logprobs_field(self._logprobs), "finish_reason": finish}
        body = self._envelope(self.OBJECT, choice, self._prompt_token_ids, self._token_ids)
        body["usage"] = self._usage()
        body.update(extra or {})
        return ClientOutput(
            self._params.echo_text + "".join(self._text),
            json.dumps(body, ensure_ascii=False),
            self._prompt_token_ids,
            self._token_ids,
            finish,
        )

    def _logprobs_field(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        """A choice's `logprobs`, only when the request asked for them."""
        return {"logprobs": {"content": self._speller.content(entries)}} if self._params.logprobs else {}

    def _envelope(self, kind: str, choice: dict, prompt_ids: list[int], token_ids: list[int]) -> dict:
        body = {
            "id": self._params.request_id,
            "object": kind,
            "created": self._params.created,
            "model": self._params.model,
        }
        if self._params.return_token_ids:
            choice["token_ids"] = token_ids
            if prompt_ids:
                body["prompt_token_ids"] = prompt_ids
        body["choices"] = [choice]
        return body

    def _usage(self) -> dict:
        prompt, completion = len(self._prompt_token_ids), len(self._token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self._cached_tokens},
        }


class CompletionAssembler(ResponseAssembler):
    """A completions request's outputs: the raw text (no reasoning or tool-call parsing), the
    prompt's text first with `echo` (in the first chunk when streaming), logprobs in the
    completions shape with each token's `text_offset` into the choice's text."""

    OBJECT = CHUNK_OBJECT = "text_completion"
    _spelled = 0  # streaming: characters of the tokens spelled so far (text_offset past the echo)

    @cached_property
    def _echo(self) -> str:
        return self._speller.text(self._prompt_token_ids) if self._params.echo else ""

    def _parse(self, delta: Delta) -> ParsedDelta:
        return ParsedDelta()

    def _chunk(self, delta: Delta, parsed: ParsedDelta, finish: str) -> ClientOutput:
        text = (self._echo if self._first else "") + delta.text
        prompt_ids = self._prompt_token_ids if self._first else []
        choice = self._choice(text, delta.logprobs, len(self._echo) + self._spelled, finish or None)
        if choice["logprobs"]:
            self._spelled += sum(len(token) for token in choice["logprobs"]["tokens"])
        body = self._envelope(self.CHUNK_OBJECT, choice, prompt_ids, delta.token_ids)
        self._first = False
        return ClientOutput(text, json.dumps(body, ensure_ascii=False), prompt_ids, delta.token_ids, finish)

    def _completion(self, finish: str, extra: dict[str, Any] | None = None) -> ClientOutput:
        text = self._echo + "".join(self._text)
        choice = self._choice(text, self._logprobs, len(self._echo), finish)
        body = self._envelope(self.OBJECT, choice, self._prompt_token_ids, self._token_ids)
        body["usage"] = self._usage()
        body.update(extra or {})
        return ClientOutput(text, json.dumps(body, ensure_ascii=False), self._prompt_token_ids, self._token_ids, finish)

    def _choice(self, text: str, entries: list[TokenLogprobs], offset: int, finish: str | None) -> dict[str, Any]:
        logprobs = self._speller.completion_logprobs(entries, offset) if self._params.logprobs else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


def response_assembler(
    params: GenerationParams,
    prompt_token_ids: list[int],
    parser: OutputParser | HarmonyOutputParser,
    speller: TokenSpeller,
    first_output_sent: bool = False,
) -> ResponseAssembler:
    """The assembler of the request's API: completions or chat."""
    kind = CompletionAssembler if params.completion else ResponseAssembler
    return kind(params, prompt_token_ids, parser, speller, first_output_sent)


def remote_prefill_output(
    params: GenerationParams,
    prompt_token_ids: list[int],
    first: Delta,
    speller: TokenSpeller,
    kv_transfer_params: dict[str, Any],
) -> ClientOutput:
    """Prefill's whole answer to a do_remote_decode request: the first token only (like
    vLLM's prefill with max_tokens=1), with its logprobs if asked; the decode server produces
    the answer. The JSON carries kv_transfer_params at top level with the prompt ids listed,
    as vLLM returns them, so a vLLM-style proxy copies them into the decode request as they are."""
    parser = OutputParser(reasoning=False, tools=False)
    assembler = response_assembler(replace(params, stream=False), prompt_token_ids, parser, speller)
    assembler.on_delta(first)
    return assembler._completion(
        "length", {"kv_transfer_params": {**kv_transfer_params, "prompt_token_ids": prompt_token_ids}}
    )
