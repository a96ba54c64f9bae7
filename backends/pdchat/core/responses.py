"""Shape decode's deltas into what clients read: text_output and OpenAI JSON.

Streaming: one output per delta (`chat.completion.chunk`). Not streaming: one output
at the end (`chat.completion`). Both carry the token ids as binary tensors too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdchat.core.generation import Delta
from pdchat.core.protocol import GenerationParams


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


class ResponseAssembler:
    def __init__(self, params: GenerationParams, prompt_token_ids: list[int]):
        self._params = params
        self._prompt_token_ids = prompt_token_ids
        self._first = True
        self._text: list[str] = []
        self._token_ids: list[int] = []

    def on_delta(self, delta: Delta) -> ClientOutput | None:
        """The output this delta produces now, if any."""
        self._text.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        if self._params.stream:
            return self._chunk(delta)
        if delta.finish_reason:
            return self._completion(delta.finish_reason)
        return None

    def _chunk(self, delta: Delta) -> ClientOutput:
        message = {"content": delta.text}
        prompt_ids: list[int] = []
        if self._first:
            message = {"role": "assistant", **message}
            prompt_ids = self._prompt_token_ids
        choice = {"index": 0, "delta": message, "finish_reason": delta.finish_reason}
        body = self._envelope("chat.completion.chunk", choice, prompt_ids, delta.token_ids)
        if delta.finish_reason:
            body["usage"] = self._usage()
        self._first = False
        return ClientOutput(delta.text, json.dumps(body, ensure_ascii=False), prompt_ids, delta.token_ids, delta.finish_reason or "")

    def _completion(self, finish_reason: str) -> ClientOutput:
        text = "".join(self._text)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        body = self._envelope("chat.completion", choice, self._prompt_token_ids, self._token_ids)
        body["usage"] = self._usage()
        return ClientOutput(
            self._params.echo_text + text,
            json.dumps(body, ensure_ascii=False),
            self._prompt_token_ids,
            self._token_ids,
            finish_reason,
        )

    def _envelope(self, kind: str, choice: dict, prompt_ids: list[int], token_ids: list[int]) -> dict:
        body = {"id": self._params.request_id, "object": kind, "created": self._params.created, "model": self._params.model}
        if self._params.return_token_ids:
            choice["token_ids"] = token_ids
            if prompt_ids:
                body["prompt_token_ids"] = prompt_ids
        body["choices"] = [choice]
        return body

    def _usage(self) -> dict:
        prompt, completion = len(self._prompt_token_ids), len(self._token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
