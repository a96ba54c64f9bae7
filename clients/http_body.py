"""A request body, read and parsed within the front's limits (`HttpSettings`): its size,
checked against Content-Length before reading and against what arrived while reading,
and its JSON nesting, checked before parsing (json.loads recurses per level).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request

from pdchat.clients.http_errors import ApiError, body_too_large

# Bodies up to this size are parsed on the event loop (~0.2 ms at the limit, ~0.04 ms for a
# 2 kB chat), larger ones in a worker thread (`json_body`).
INLINE_JSON_BYTES = 16 * 1024

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)  # '"?': never backtracks
_BRACKET_STEP = np.array([1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)], np.int32)


class JsonTooDeep(ValueError):
    pass


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data`, found without recursion, in
    linear time: strings are cut out (an unterminated one runs to the end), then the
    highest running sum of +1 per opening and -1 per closing bracket (numpy: a 4 MiB
    body of brackets takes ~25 ms, a Python loop ten times that, holding the GIL)."""
    steps = _BRACKET_STEP[np.frombuffer(_JSON_STRING.sub(b"", data), np.uint8)]
    return int(steps.cumsum().max(initial=0))


def parse_json_body(data: bytes, max_depth: int) -> dict[str, Any]:
    """The request body as a JSON object; ValueError (JsonTooDeep for nesting) otherwise."""
    if json_depth(data) > max_depth:
        raise JsonTooDeep(f"the JSON body nests deeper than the allowed depth of {max_depth}")
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


async def json_body(
    request: Request,
    max_bytes: int,
    max_depth: int,
    in_thread: Callable[..., Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """The body parsed: on the event loop up to INLINE_JSON_BYTES (a chat's first token
    skips two thread hops), by `in_thread` beyond, so a large body does not hold up the
    streams this loop serves. ApiError 400 or 413 when it is no JSON object within the limits."""
    data = await read_body(request, max_bytes)
    try:
        if len(data) <= INLINE_JSON_BYTES:
            return parse_json_body(data, max_depth)
        return await in_thread(parse_json_body, data, max_depth)
    except JsonTooDeep as exc:
        raise ApiError(400, str(exc), "json_too_deep") from exc
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", "invalid_json") from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit` bytes: by its declared
    length before reading, else by what has arrived (chunked bodies declare none).

    NOTE: a client that leaves meanwhile, or one the protocol refused while the body was
    being read (its `refusal`, clients/http_limits.py), ends it with an ApiError."""
    too_large = body_too_large(limit)
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:  # h11 let only digits through
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect as exc:
        refusal = getattr(request.state, "refusal", None)
        if refusal is not None:  # the protocol answered it (DeadlineH11Protocol._refuse): counted here
            raise refusal from exc
        request.state.outcome = "cancelled"
        raise ApiError(400, "the client left before sending the whole body", "client_disconnected", close=True) from exc
    return b"".join(chunks)
