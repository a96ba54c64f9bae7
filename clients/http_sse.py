"""A streamed answer as server-sent events: one `data:` event per chunk, the servers' JSON
passed on as the text it came in, an error after the first chunk as a chunk of its own,
then `data: [DONE]`.

However the response ends (the answer's end, an error, the client leaving mid-send), the
answer's outputs are closed, which cancels its requests on the servers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.datastructures import State
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdchat.clients.chat import ChatError, ChatOutput, ChatStream
from pdchat.clients.http_errors import chat_api_error, outcome_of
from pdchat.clients.http_metrics import FrontMetrics

log = logging.getLogger("pdchat.router.http")

DONE = b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends: a client
    that leaves while a chunk is being sent must cancel the decode request too."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def event(data: dict[str, Any] | str) -> bytes:
    """One SSE event; a server's response JSON goes out as the text it came in."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return b"data: " + text.encode() + b"\n\n"


async def answer_events(
    first: ChatOutput, outputs: ChatStream, state: State, metrics: FrontMetrics
) -> AsyncIterator[bytes]:
    """The events of an answer whose `first` output is here and the rest are `outputs`, which
    are closed however this ends (cancelling what still runs on the servers). Sets the request's
    `state.outcome`, and counts chunk gaps and streamed errors in `metrics`."""
    try:
        output: ChatOutput | None = first
        last = time.perf_counter()
        try:
            while output is not None:
                yield event(output.response_json)
                output = await anext(outputs, None)
                now = time.perf_counter()
                if output is not None:
                    metrics.inter_token.observe(now - last)
                last = now
            state.outcome = "ok"
        except ChatError as exc:
            error = chat_api_error(exc)
            state.outcome = outcome_of(error.status)
            metrics.count_error(error)
            yield event(error.body())
        yield DONE
    except Exception:
        state.outcome = "server_error"  # a bug, not a client leaving
        raise
    finally:
        if getattr(state, "outcome", None) is None:
            state.outcome = "cancelled"
            log.info("request %s: client went away; decode work cancelled", state.request_id)
        with anyio.CancelScope(shield=True):
            await outputs.aclose()
