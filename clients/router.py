"""P/D router: prefill on one server, decode on another, one OpenAI-compatible front.

`PDRouter` drives the two legs over gRPC: the prefill server's `chat` renders, prefills and
answers signed kv_transfer_params; the decode server's `chat` gets the same request plus
those params and the ids as a binary tensor, so it neither renders nor tokenizes. Fallbacks
lose no request: prefill unreachable, failing or stalled -> decode serves the request whole;
decode unreachable -> a clear error. Each leg streams from a `BackendPool`
(clients/backend_pool.py); `pdchat.clients.openai_api` serves the router over HTTP.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from pdchat import tensors
from pdchat.clients.affinity import PrefixAffinity, prefix_keys
from pdchat.clients.backend_pool import BackendPool, Draining
from pdchat.clients.chat import ChatError, ChatOutput, ChatStream, chat_inputs
from pdchat.clients.fronts import ChatFront, owner_parameters
from pdchat.clients.kv_index import BlockIndex, KVEventSource, KVEventSubscriber
from pdchat.core.errors import ErrorCode
from pdchat.core.settings import KV_BLOCK_TOKENS

log = logging.getLogger("pdchat.router")


@dataclass
class _Prefilled:
    """What a prefill leg leaves the decode leg: prefill's answer (None: decode serves the
    request whole), and whether the answer's first output went out already."""

    answer: ChatOutput | None = None
    first_sent: bool = False


class PDRouter(ChatFront):
    """Prefill on one pool, decode on another. `forward_ids=False` is the comparison mode of
    the benchmarks (vLLM before it forwarded ids): decode gets the signed handoff without
    the ids and renders itself. `stall_timeout_s`: None reads the setting. `policy` picks
    the prefill server: `prefix` (a conversation's next turn goes where its prefix is
    cached, clients/affinity.py) or `least-loaded`.

    `kv_events`: the prefill servers (by address) whose KV events the prefix policy reads,
    each on a subscriber thread of its own, so what a server evicted no longer draws a
    conversation there (clients/kv_index.py); blocks of `kv_event_block_size` tokens (None:
    setting KV_BLOCK_TOKENS, as the servers read it). `outputs`: what its streams request of
    chat (None: every output; the HTTP fronts request tensors.FRONT_OUTPUTS). Decode servers'
    answers stream from their decode model itself (tickets, through its feed). Call close() to
    stop the subscribers."""

    POLICIES = ("prefix", "least-loaded")

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        forward_ids: bool = True,
        stall_timeout_s: float | None = None,
        served_model_names: Sequence[str] = (),
        policy: str = "prefix",
        kv_events: dict[str, KVEventSource] | None = None,
        kv_event_block_size: int | None = None,
        outputs: tuple[str, ...] | None = None,
    ):
        if policy not in self.POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(self.POLICIES)}, got {policy!r}")
        kv_events = kv_events or {}
        if kv_events and policy != "prefix":
            raise ValueError("KV events feed the prefix policy: they need policy prefix")
        if unknown := sorted(set(kv_events) - set(prefill_urls)):
            raise ValueError(f"KV events of {', '.join(unknown)}, which is no prefill server here")
        decode = BackendPool(
            decode_urls, "decode", stall_timeout_s=stall_timeout_s, outputs=outputs, decode_direct=True
        )
        super().__init__(decode, served_model_names)
        # A prefill leg's answer also gives the prompt ids the decode leg is forwarded.
        prefill_outputs = None if outputs is None else tuple(dict.fromkeys((*outputs, tensors.PROMPT_TOKEN_IDS)))
        self.prefill = BackendPool(prefill_urls, "prefill", stall_timeout_s=stall_timeout_s, outputs=prefill_outputs)
        self.decode = self.serving
        self.forward_ids = forward_ids
        block_size = KV_BLOCK_TOKENS.get() if kv_event_block_size is None else kv_event_block_size
        self.kv_indexes = {url: BlockIndex(block_size) for url in kv_events}
        self.affinity = PrefixAffinity(indexes=self.kv_indexes) if policy == "prefix" else None
        if self.affinity is not None:
            self.prefill.on_unready = self.affinity.forget
        self._subscribers = [
            KVEventSubscriber(
                self.kv_indexes[url],
                source.endpoint,
                source.replay_endpoint,
                on_reset=functools.partial(self.affinity.forget, url),
            )
            for url, source in kv_events.items()
        ]

    @property
    def pools(self) -> tuple[BackendPool, ...]:
        return (self.prefill, self.decode)

    @property
    def renderer_pools(self) -> tuple[BackendPool, ...]:
        """Prefill's renderers (they render the chat requests), decode's while none is ready."""
        return (self.prefill, self.decode)

    async def chat(
        self, body: dict[str, Any], request_id: str = "", form: str = tensors.REQUEST, owner: str = ""
    ) -> ChatStream:
        """The decode server's responses for one chat or completions request (streamed if body asks)."""
        request_id = request_id or f"pdchat-{uuid.uuid4().hex}"
        self.stats.requests += 1
        text, chat = self._validated(body, form)
        for routers_own in ("kv_transfer_params", "prompt_token_ids"):
            if getattr(chat, routers_own) is not None:
                message = f"{routers_own} is the router's to set: send the conversation only"
                raise ChatError(message, ErrorCode.INVALID_ARG)
        if not self.decode.any_healthy():
            # Prefill work for a request no decode server can finish would only pile up KV.
            self.stats.failed += 1
            raise self.decode.none_ready()
        keys = prefix_keys(body) if self.affinity is not None else []  # only the prefix policy reads them
        # The client has the first output as soon as prefill sent it; the decode leg's stream goes on after it.
        prefilled = _Prefilled()
        async with aclosing(self._prefill_leg(text, request_id, form, keys, prefilled)) as first:
            async for output in first:
                yield output
        answer = prefilled.answer
        forwarded: dict[str, Any] = {}
        parameters: dict[str, Any] = owner_parameters(owner) or {}
        if answer is not None:
            # The signed handoff goes on as the prefill server serialized it.
            forwarded = {"kv_transfer_params": answer.kv_transfer_params_json}
            if self.forward_ids:
                forwarded["prompt_token_ids"] = answer.prompt_token_ids
            self.stats.disaggregated += 1
            if prefilled.first_sent:
                parameters[tensors.FIRST_OUTPUT_SENT] = True
        async with aclosing(self._stream(text, request_id, form, parameters, **forwarded)) as rest:
            async for output in rest:
                yield output

    async def _prefill_leg(
        self, body: bytes, request_id: str, form: str, keys: list[bytes], prefilled: _Prefilled
    ) -> ChatStream:
        """Yields the streamed answer's first output the moment the prefill server sends it
        (when it does); leaves in `prefilled` prefill's answer (first token, prompt ids, signed
        handoff) and whether that first output went out, or no answer to let decode do it all:
        no prefill server ready, or the one picked failed or stalled before the first output
        went out. A do_remote_decode request gets one answer (the response with
        kv_transfer_params), streamed or not, and with ids forwarded the first output before
        it (tensors.FIRST_OUTPUT_EARLY). `keys`: the request's prefix keys, for the prefix
        policy.

        NOTE: once the first output went out the request is this prefill's: a failure then
        ends it (decode alone would send the client a first output again)."""
        started = time.perf_counter()
        choose = None if self.affinity is None else functools.partial(self.affinity.choose, keys)
        try:
            with self.prefill.pick(choose) as used:
                inputs = chat_inputs(body, kv_transfer_params={"do_remote_decode": True}, form=form)
                # The first output may go before the decode leg only where the decode server takes
                # the handle as it is (REUSE): it continues the prefill leg's answer there.
                parameters = {tensors.FIRST_OUTPUT_EARLY: True} if self.forward_ids else None
                answer = None
                async with aclosing(self.prefill.stream(used, inputs, request_id, parameters)) as outputs:
                    async for output in outputs:
                        is_answer = bool(output.kv_transfer_params_json) or not self.forward_ids
                        if answer is not None or (prefilled.first_sent and not is_answer):
                            extra = "more than a first output and an answer"
                            raise ChatError(f"prefill server {used.url} answered {extra}")
                        if is_answer:
                            answer = output
                        else:
                            prefilled.first_sent = True
                            yield output
                if answer is None:
                    raise ChatError(f"prefill server {used.url} ended its stream without an answer")
            log.info(
                "request %s: prefill on %s in %.1f ms", request_id, used.url, 1000 * (time.perf_counter() - started)
            )
            index = self.kv_indexes.get(used.url)
            if index is not None and keys:  # its blocks are on that server now: affinity holds while they are
                self.affinity.bind(used.url, keys[-1], index.prompt_key(answer.prompt_token_ids))
            prefilled.answer = answer
        except ChatError as exc:
            if prefilled.first_sent or exc.is_client_error or isinstance(exc, Draining):
                # the request itself is bad (decode would refuse it too), the front stops, or the
                # client has this prefill's first output
                raise
            self.stats.prefill_fallbacks += 1
            log.warning("request %s: prefill failed (%s: %s); decode serves it whole", request_id, exc.code.name, exc)

    def health(self) -> dict[str, Any]:
        health = {**super().health(), "prefill": self.prefill.probe_all()}
        if self.affinity is not None:  # leading messages routed to a server that had them before
            health["stats"] = {
                **health["stats"],
                "prefix_matched_messages": self.affinity.matched_messages,
                "prefix_routed_messages": self.affinity.routed_messages,
            }
        if self.kv_indexes:  # what each server's KV events told
            health["kv_events"] = {
                url: {"blocks": len(index), **asdict(index.stats)} for url, index in self.kv_indexes.items()
            }
        return health

    def close(self) -> None:
        """Stop the KV event subscribers."""
        for subscriber in self._subscribers:
            subscriber.close()


def stream_completion(router_url: str, body: dict[str, Any], timeout: float = 600.0) -> Iterator[dict[str, Any]]:
    """Client side of the router API: the chunks of a streamed chat completion (SSE)."""
    import urllib.request

    request = urllib.request.Request(
        f"{router_url}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        for line in reply:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:  # its code: an ErrorCode's openai_code (http_errors.chat_api_error)
                    error = chunk["error"]
                    raise ChatError(error["message"], ErrorCode.from_openai_code(error.get("code", "")))
                yield chunk
