"""`n` > 1 at the OpenAI fronts: a request's n choices, each served as a request of one choice.

`fan_out(serve, body, request_id, form)` serves a chat or completions body asking for `n`
choices (at most MAX_CHOICES) through `serve` (`ChatFront.chat`) as n bodies without `n`:
choice i is seeded `seed + i` when the body has a `seed`, so one seed reproduces all n
(without one, each choice draws its own). The servers see plain requests: P/D, the gate and
the KV connectors are a single choice's.

One prefill, through the prefix cache: choice 0 goes first, and choice i starts once choice
i - 1's first chunk (streamed) or choice 0's whole answer (not streamed) is back, so the
prompt's full blocks are cached when the next prefill looks them up (a prefill takes its
cached blocks when it takes the prompt: choices started together would all miss). Each
later choice computes only the prompt's tail after its last full block
(`pdchat_prompt_tokens_computed_total`; docs/kv-cache.md).

Streamed, chunks are relayed as they come, the choices in turns, each with its `index` and
choice 0's id; the choices' usage chunks (stream_options.include_usage) become one at the
end. Whole, one answer holds the n choices. Usage: the prompt counted once (choice 0's,
with its cached tokens), the completion tokens summed, as vLLM reports n choices.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from pdchat.clients.chat import ChatError, ChatOutput, ChatStream
from pdchat.core.errors import ErrorCode

MAX_CHOICES = 16  # a bound on the requests one body fans out to
SEED_MODULUS = 1 << 63  # the servers take a seed modulo this (protocol's _seed)
SEED_LIMIT = 1 << 64  # the servers parse no JSON integer at or past it: no n takes such a seed

Serve = Callable[[dict[str, Any], str, str], ChatStream]  # ChatFront.chat


# The fields of one request's P/D handoff (vLLM's wire form), which cannot serve n requests.
HANDOFF_FIELDS = ("kv_transfer_params", "prompt_token_ids")


def choice_count(body: dict[str, Any]) -> int:
    """The body's `n` (1 if absent), else ChatError INVALID_ARG naming it. n > 1 is refused
    beside a handoff (HANDOFF_FIELDS): a signed handoff is admitted once, so choice 1 on would
    be refused `replayed` after choice 0 ran (its chunks already sent, streamed), and a
    prefill leg's n handoffs would hold n KVs to their expiry with one answered."""
    n = body.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise ChatError(f"'n' must be an integer in [1, {MAX_CHOICES}], got {n!r}", ErrorCode.INVALID_ARG)
    if n > 1 and (given := [key for key in HANDOFF_FIELDS if body.get(key) is not None]):
        raise ChatError(
            f"'n' > 1 with {' and '.join(given)}: a P/D handoff serves one request; send n = 1 to each "
            "server (a front before both, such as pdchat's router, serves n choices itself)",
            ErrorCode.INVALID_ARG,
        )
    return n


def choice_bodies(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The n one-choice bodies: `n` left out, choice i seeded `seed + i` when a seed is given
    (a seed that is no integer, or a negative one, stays as it is, for the parser to refuse by
    name; one of 2**64 or more is refused here, as a server refuses it for n = 1). The servers
    take a seed modulo 2**63, so `seed + i` is sent so reduced: the servers
    parse JSON integers past 2**64 - 1 as floats and refuse them, which failed choice i of a seed
    just below 2**64 after the choices before it ran."""
    single = {key: value for key, value in body.items() if key != "n"}
    seed = body.get("seed")
    if type(seed) is not int:
        return [single] * n
    if seed >= SEED_LIMIT:
        raise ChatError(f"'seed' must be a non-negative integer below 2**64, got {seed}", ErrorCode.INVALID_ARG)
    if seed < 0:
        return [{**single, "seed": seed + i} for i in range(n)]
    return [{**single, "seed": (seed + i) % SEED_MODULUS} for i in range(n)]


async def fan_out(serve: Serve, body: dict[str, Any], request_id: str, form: str) -> ChatStream:
    """The outputs of `body` (of API `form`) with its n choices: those of `serve` when n is 1."""
    n = choice_count(body)
    if n == 1:
        async with aclosing(serve(body, request_id, form)) as outputs:
            async for output in outputs:
                yield output
        return
    requests = [(choice, f"{request_id}-{i}", form) for i, choice in enumerate(choice_bodies(body, n))]
    if body.get("stream") is True:
        async with aclosing(_streamed(serve, requests)) as chunks:
            async for chunk in chunks:
                yield chunk
    else:
        yield await _whole(serve, requests)


async def _streamed(serve: Serve, requests: list[tuple[dict[str, Any], str, str]]) -> ChatStream:
    """The choices' chunks in turns, one of each per turn. A stream starts when it is first
    read, in its turn, so choice i's request is sent once choice i - 1's first chunk is here."""
    streams = [serve(*request) for request in requests]
    merged = _Merged()
    try:
        live = list(range(len(streams)))
        while live:
            for i in list(live):
                output = await anext(streams[i], None)
                if output is None:
                    live.remove(i)
                elif (chunk := merged.chunk(i, output)) is not None:
                    yield chunk
        if merged.usages:
            yield merged.usage_chunk()
    finally:
        for stream in streams:
            await stream.aclose()  # cancels the choices still running


async def _whole(serve: Serve, requests: list[tuple[dict[str, Any], str, str]]) -> ChatOutput:
    """One answer with every choice: choice 0's first, then the others together (the first
    of them to fail cancels the rest)."""
    first = await _answer(serve, requests[0])
    others = [asyncio.ensure_future(_answer(serve, request)) for request in requests[1:]]
    try:
        answers = [first, *await asyncio.gather(*others)]
    finally:
        for other in others:
            other.cancel()
    merged = dict(first.response)
    merged["choices"] = [{**answer.response["choices"][0], "index": i} for i, answer in enumerate(answers)]
    merged["usage"] = merge_usage([answer.response["usage"] for answer in answers])
    return ChatOutput(
        "".join(answer.text for answer in answers),
        json.dumps(merged, ensure_ascii=False),
        first.prompt_token_ids,
        [],
        first.finish_reason,
    )


async def _answer(serve: Serve, request: tuple[dict[str, Any], str, str]) -> ChatOutput:
    async with aclosing(serve(*request)) as outputs:
        answers = [output async for output in outputs]
    if len(answers) != 1:
        raise ChatError(f"a server sent {len(answers)} responses for a whole answer", ErrorCode.INTERNAL)
    return answers[0]


def merge_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """n choices' usage as one: the prompt (and its cached tokens) once, the completions summed."""
    completion = sum(usage["completion_tokens"] for usage in usages)
    return {**usages[0], "completion_tokens": completion, "total_tokens": usages[0]["prompt_tokens"] + completion}


class _Merged:
    """Streamed chunks of n choices as one stream's: each choice's `index`, choice 0's id;
    usage chunks kept for one at the end."""

    def __init__(self):
        self.id: str | None = None
        self.usages: dict[int, dict[str, Any]] = {}  # by choice
        self._usage_chunk: dict[str, Any] = {}

    def chunk(self, index: int, output: ChatOutput) -> ChatOutput | None:
        """Choice `index`'s chunk as the merged stream sends it; None for a usage chunk."""
        response = dict(output.response)
        self.id = self.id or response.get("id")
        response["id"] = self.id
        if not response.get("choices") and "usage" in response:
            self.usages[index] = response["usage"]
            self._usage_chunk = response
            return None
        response["choices"] = [{**choice, "index": index} for choice in response["choices"]]
        return ChatOutput(
            output.text,
            json.dumps(response, ensure_ascii=False),
            output.prompt_token_ids,
            output.output_token_ids,
            output.finish_reason,
        )

    def usage_chunk(self) -> ChatOutput:
        chunk = {**self._usage_chunk, "usage": merge_usage([self.usages[i] for i in sorted(self.usages)])}
        return ChatOutput("", json.dumps(chunk, ensure_ascii=False))
