"""What the OpenAI HTTP front serves (`ChatFront`), and its plainest kind (`ServerFront`):
one pdchat server's `chat`, as vLLM serves one engine.

A front validates each body before any server sees it (a bad request is the client's error,
never a server failure), streams its answer from a `BackendPool`, and answers the front's
other routes: the served model names, /tokenize and /detokenize (a server's renderer),
health and stats. `PDRouter` (clients/router.py) is the front of a P/D pair of pools.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pdchat import tensors
from pdchat.clients.backend_pool import BackendPool
from pdchat.clients.chat import ChatError, ChatStream, chat_inputs
from pdchat.core.errors import InvalidRequest
from pdchat.core.request.protocol import (
    ChatRequest,
    chat_request_from_body,
    check_served_model,
    completion_request_from_body,
    utf8_json,
)
from pdchat.core.request.tokenize import parse_detokenize, parse_tokenize

# The `chat` input a body travels as (chat completions, completions), and how the front
# validates it first (without the grammar compiler: the router has no torch).
BODY_VALIDATORS = {
    tensors.REQUEST: functools.partial(chat_request_from_body, check_grammar=False),
    tensors.COMPLETION_REQUEST: completion_request_from_body,
}


def owner_parameters(owner: str) -> dict[str, Any] | None:
    """chat's request parameters that name `owner` (tensors.KV_OWNER), None for no owner."""
    return {tensors.KV_OWNER: owner} if owner else None


@dataclass
class RouterStats:
    requests: int = 0
    disaggregated: int = 0
    prefill_fallbacks: int = 0
    failed: int = 0


class ChatFront:
    """What the OpenAI HTTP front (clients/openai_api.py) serves: chat requests streamed from
    the `chat` model of a pool of servers, the served model names, health and stats.

    `served_model_names` (--served-model-name): the names a request's `model` may give,
    checked here (ModelNotFound: 404 model_not_found) and listed by /v1/models; a request
    goes to the servers without its `model`, so they serve it whatever names they have (their
    answers report theirs). None given: the name a server reports, and the servers alone check.
    Either way /v1/models answers 503 while no server is ready, as a request would."""

    def __init__(self, serving: BackendPool, served_model_names: Sequence[str] = ()):
        self.serving = serving
        self.stats = RouterStats()
        self.served_model_names = tuple(served_model_names)
        self._served_model: str | None = None

    @property
    def pools(self) -> tuple[BackendPool, ...]:
        """Every pool this front streams from."""
        return (self.serving,)

    def chat(
        self, body: dict[str, Any], request_id: str = "", form: str = tensors.REQUEST, owner: str = ""
    ) -> ChatStream:
        """The responses to one body of the API `form` names (a BODY_VALIDATORS key: chat
        completions, or completions), streamed if it asks, on the running event loop.
        Closing or cancelling it cancels its requests on the servers. `owner`: the caller whose
        share of decode's KV it counts against (tensors.KV_OWNER; "": the request is its own)."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """End every running stream with Draining(reason), cancelling its request on its
        server; streams asked for later end so at once."""
        for pool in self.pools:
            pool.abort(reason)

    async def served_models(self) -> tuple[str, ...]:
        """The model names clients may send, the one reported first; ChatError UNAVAILABLE
        while no server is ready (probed now, in a worker thread: a list is no hot path)."""
        if not any((await asyncio.to_thread(self.serving.probe_all)).values()):
            raise self.serving.none_ready()
        return self.served_model_names or (await self.served_model(),)

    async def served_model(self) -> str:
        """The model name answers report: the first served name, else asked of a server once."""
        if self.served_model_names:
            return self.served_model_names[0]
        if self._served_model is None:
            probe = chat_inputs({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            with self.serving.pick() as backend:
                [answer] = [output async for output in self.serving.stream(backend, probe)]
            self._served_model = answer.response["model"]
        return self._served_model

    @property
    def renderer_pools(self) -> tuple[BackendPool, ...]:
        """The pools whose renderer answers /tokenize and /detokenize, in order of preference."""
        return (self.serving,)

    async def tokenize(self, body: dict[str, Any], request_id: str = "") -> dict[str, Any]:
        """vLLM's /tokenize answer (pdchat.core.request.tokenize): a server's renderer model
        renders a chat as it renders that chat completion, so the ids are those chat computes."""
        self._checked(parse_tokenize, body)
        return await self._renderer_answer(tensors.TOKENIZE_REQUEST, body, request_id)

    async def detokenize(self, body: dict[str, Any], request_id: str = "") -> dict[str, Any]:
        """vLLM's /detokenize answer: the ids' text, by a server's tokenizer."""
        self._checked(parse_detokenize, body)
        return await self._renderer_answer(tensors.DETOKENIZE_REQUEST, body, request_id)

    def health(self) -> dict[str, Any]:
        """Whether each server is ready (probed now: this blocks), and the front's stats."""
        status = {self.serving.role: self.serving.probe_all(), "stats": self.stats.__dict__}
        status["ok"] = any(status[self.serving.role].values())
        return status

    def _validated(self, body: dict[str, Any], form: str) -> tuple[bytes, ChatRequest]:
        """The body as the bytes every server gets as input `form`, once it is known valid
        here (a bad request is the client's error, never a server failure)."""
        try:
            chat = BODY_VALIDATORS[form](body)
            if self.served_model_names:
                check_served_model(chat.model, self.served_model_names)
            return utf8_json(self._for_servers(body)), chat
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc

    def _for_servers(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` as the servers get it: without its `model` where this front checked it
        against its own names (a server's names may differ)."""
        if not self.served_model_names or "model" not in body:
            return body
        return {key: value for key, value in body.items() if key != "model"}

    def _checked(self, parse: Any, body: dict[str, Any]) -> Any:
        """`parse(body)`, and its model among the served names where this front has them;
        a bad body is the client's error."""
        try:
            request = parse(body)
            if self.served_model_names:
                check_served_model(request.model, self.served_model_names)
            return request
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc

    async def _renderer_answer(self, name: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """The renderer's JSON answer to `body` as input `name`, from the first pool with a
        ready server (errors as `BackendPool.stream` says, but for stalls: its client's timeout),
        asked by a worker thread (GrpcChat.answer blocks)."""
        try:
            text = utf8_json(self._for_servers(body))
        except InvalidRequest as exc:
            raise ChatError(str(exc), exc.code) from exc
        pool = next((p for p in self.renderer_pools if p.any_healthy()), self.renderer_pools[0])
        with pool.pick() as backend, backend.client() as client:
            request_id = request_id or f"pdchat-{uuid.uuid4().hex}"
            try:
                return await asyncio.to_thread(client.answer, tensors.RENDERER, name, text, request_id)
            except ChatError as exc:
                error = await pool._failure(backend, exc)
                if error is exc:
                    raise
                raise error from exc

    async def _stream(
        self, text: bytes, request_id: str, form: str, parameters: dict[str, Any] | None = None, **forwarded: Any
    ) -> ChatStream:
        """Responses of one serving server to `text` as input `form` (errors as `BackendPool.stream` says)."""
        if not self.serving.any_healthy():
            self.stats.failed += 1
            raise self.serving.none_ready()
        with self.serving.pick() as backend:
            try:
                inputs = chat_inputs(text, form=form, **forwarded)
                async with aclosing(self.serving.stream(backend, inputs, request_id, parameters)) as outputs:
                    async for output in outputs:
                        yield output
            except ChatError:
                self.stats.failed += 1
                raise


class ServerFront(ChatFront):
    """One pdchat server's `chat` behind the OpenAI front, as vLLM serves one engine: for a
    router of its own (vllm-router, production-stack) that drives P/D itself. The body goes
    as is, `kv_transfer_params` included; a prefill answer carries them back in its JSON.
    Answers stream from the server's decode model itself (tickets, through its feed)."""

    def __init__(
        self,
        url: str,
        role: str = "server",
        stall_timeout_s: float | None = None,
        served_model_names: Sequence[str] = (),
        outputs: tuple[str, ...] | None = None,
    ):
        pool = BackendPool([url], role, stall_timeout_s=stall_timeout_s, outputs=outputs, decode_direct=True)
        super().__init__(pool, served_model_names)

    async def chat(
        self, body: dict[str, Any], request_id: str = "", form: str = tensors.REQUEST, owner: str = ""
    ) -> ChatStream:
        self.stats.requests += 1
        text, _ = self._validated(body, form)
        request_id = request_id or f"pdchat-{uuid.uuid4().hex}"
        async with aclosing(self._stream(text, request_id, form, owner_parameters(owner))) as outputs:
            async for output in outputs:
                yield output
