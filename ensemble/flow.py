"""The `chat` model's flow, once and without Triton: route a request, call the stages, relay decode.

`ChatFlow.serve` takes one parsed request and a `ChatStages` executor, the transport to the
stage models. `model_repository/chat` serves it with BLS calls (`pdchat.triton.chat_stages`);
`tests/pipeline.py` serves it in one process. Routes (`pdchat.ensemble.routing`):

- REUSE: forwarded ids the gate admitted, sealed here, go straight to decode; no render;
- RENDER: render -> prefill (KV over shm, to this server's decode) -> decode, a streamed
  answer's first output sent from prefill's answer before decode starts, unless decode
  may not take the request as it comes (`DecodeLoad.has_room`: it may wait, or be refused,
  and a refusal must come before any output); with
  setting local_prefill_when_idle, a lone request while decode holds no sequence
  (`DecodeLoad`) goes render -> decode, which prefills the prompt itself, as every one
  does with setting engine vllm;
- REMOTE_PREFILL: render -> prefill (KV through the configured connector), then one
  answer: the first token and the signed kv_transfer_params for a decode server (before
  it, when the caller asks, the streamed answer's first output, which the decode leg then
  skips);
- RENDER_VERIFIED: render, then decode with the transferred KV once the rendered ids
  pass the gate.

A render is chat's own when the request is short and has no chat_template of its own
(setting chat_render_max_chars), else the renderer model's (`ChatFlow._render`).

A client may ask for a ticket (tensors.DECODE_TICKET): where a route would relay decode's
stream, it answers once with decode's sealed inputs, and the client streams from decode
itself, so no response of decode passes through `chat`.

NOTE: everything a stage receives is sealed (`pdchat.ensemble.seal`): this flow seals what
the gate admitted and what it rendered, and passes on the seals the renderer and prefill made.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pdchat.core.errors import Unavailable
from pdchat.core.kv.base import KVHandle
from pdchat.core.output.logprobs import TokenSpeller
from pdchat.core.output.responses import ClientOutput, Delta, remote_prefill_output
from pdchat.core.request.grammar import load_xgrammar
from pdchat.core.request.protocol import ChatRequest, GenerationParams
from pdchat.core.request.render_cost import RenderRate
from pdchat.core.request.renderers import load_renderer
from pdchat.core.request.rendering import REQUEST_TEMPLATE, PromptRenderer
from pdchat.core.settings import (
    CHAT_RENDER_MAX_CHARS,
    ENGINE,
    LOCAL_PREFILL_WHEN_IDLE,
    STAGE_STALL_TIMEOUT_S,
    forwarded_ids_policy,
    handoff_ttl_s,
    kv_connector,
)
from pdchat.ensemble.decode_load import DecodeLoad
from pdchat.ensemble.gate import ForwardedIdsRejected, Gate, parse_policy
from pdchat.ensemble.handoff import load_key
from pdchat.ensemble.routing import Route, RoutePlanner
from pdchat.ensemble.seal import StageSeal, server_directory
from pdchat.registry import SHM

# How often a relayed stream asks whether its client left (each ask may be a round trip).
CANCEL_POLL_S = 0.05
IDLE_POLL_S = 1.0  # how often a relay waiting for decode looks whether its client left
# How long after a prompt went to an idle decode the next ones count as its burst
# (ChatFlow._decode_prefills).
LOCAL_BURST_S = 0.05


@dataclass(frozen=True)
class ChatInputs:
    """One request as the client contract gave it: the parsed chat, and forwarded ids with their
    kv_transfer_params when they came as inputs of their own (not inside the JSON)."""

    chat: ChatRequest
    prompt_token_ids: np.ndarray | None = None
    kv_transfer_params: str | None = None


@dataclass(frozen=True)
class Rendered:
    """A render: INT32 ids, generation params JSON and the seal over both."""

    prompt_token_ids: np.ndarray
    params_text: str
    seal: str
    render_s: float  # the render's own time, for the render-rate estimate


@dataclass(frozen=True)
class Prefilled:
    """Prefill's answer: the KV handle's JSON (first token inside), and prefill's seal over
    the prompt with that handle, which opens decode; when asked for, the stream's first
    output as decode will make it (None where it may differ: TextModel.first_output)."""

    kv_handle: str
    seal: str
    first_output: ClientOutput | None = None


@dataclass(frozen=True)
class DecodeCall:
    """Sealed input of one decode stream; `kv_handle` is "" when decode prefills itself;
    `heartbeat_s`: decode sends an empty response after this long without one (None: never);
    `first_output_sent`: the client has the first output (from prefill): decode skips it."""

    prompt_token_ids: np.ndarray | list[int]
    params: GenerationParams
    params_text: str
    seal: str
    kv_handle: str = ""
    heartbeat_s: float | None = None
    first_output_sent: bool = False


class ChatStages(Protocol):
    """The transport between `chat` and the stage models, one instance per request.

    A stage that fails raises (render, prefill) or ends the stream with an error that
    `relay` forwards; either way the client gets the stage's error code.
    """

    def routed(self, route: Route) -> None:
        """Note the route this request takes (the server logs it)."""
        ...

    async def render(self, request_json: str, seal: str) -> Rendered: ...

    async def prefill(self, rendered: Rendered, destination: str, first_output: bool) -> Prefilled:
        """Prefill the rendered prompt, its KV published through connector `destination`;
        `first_output`: ask for the stream's first output too."""
        ...

    def send(self, output: ClientOutput) -> None:
        """One output of the client's stream that is not its last (prefill's first output)."""
        ...

    def wants_first_output(self) -> bool:
        """A prefill leg's caller asked for the stream's first output before the answer
        (tensors.FIRST_OUTPUT_EARLY)."""
        ...

    def has_first_output(self) -> bool:
        """The caller has the stream's first output from the prefill leg (tensors.FIRST_OUTPUT_SENT)."""
        ...

    def decode(self, call: DecodeCall) -> AsyncIterator[Any]:
        """Decode's responses, in the transport's own form (relayed as they are)."""
        ...

    def relay(self, response: Any) -> bool:
        """Send one decode response on to the client; True once the client's stream is closed."""
        ...

    def refused(self, response: Any) -> bool:
        """True if a decode response is an error: as its stream's first, decode refused the request."""
        ...

    def answer(self, output: ClientOutput, kv_transfer_params: str) -> None:
        """The one, final response of a prefill leg (REMOTE_PREFILL)."""
        ...

    def wants_ticket(self) -> bool:
        """True if the client asked for a ticket (tensors.DECODE_TICKET) instead of decode's stream."""
        ...

    def feed_to_grant(self) -> str | None:
        """The decode feed a ticket's client asks to open (tensors.DECODE_FEED_GRANT), or None."""
        ...

    def ticket(self, call: DecodeCall, feed_seal: str | None) -> None:
        """The one, final response of a ticketed request: `call`, decode's sealed inputs, for
        the client to send decode itself; and `feed_seal`, the grant of the feed it asked for."""
        ...

    def close(self) -> None:
        """End the client's stream without a response (decode ended without a final one)."""
        ...

    def client_left(self) -> bool: ...

    async def cancel(self, request_id: str, seal: str) -> None:
        """Tell decode to stop `request_id` (a sealed control request); returns once it did."""
        ...


class HandoffObserver(Protocol):
    """Counts the gate's outcomes and the renders chat makes itself (Triton metrics in the server)."""

    def accepted(self, seconds_saved: float) -> None: ...

    def rejected(self, reason: str) -> None: ...

    def rendered(self) -> None: ...


class ChatFlow:
    """Route-and-stages for one server's `chat`; safe to share between concurrent requests."""

    def __init__(
        self,
        planner: RoutePlanner,
        renderer: PromptRenderer,
        seal: StageSeal,
        kv_connector: str,
        observer: HandoffObserver,
        render_rate: RenderRate | None = None,
        stall_timeout_s: float = STAGE_STALL_TIMEOUT_S.default_value,
        render_max_chars: int = CHAT_RENDER_MAX_CHARS.default_value,
        decode_load: DecodeLoad | None = None,
        local_prefill_when_idle: bool = False,
        decode_prefills_all: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`render_max_chars`: the longest request rendered here (`_render`; 0: none);
        `decode_load`: this server's decode's load (None: unknown, read as room left);
        with `local_prefill_when_idle`, while it reads idle decode prefills a plain prompt
        itself; with `decode_prefills_all` (engine vllm), decode prefills every plain prompt:
        its engine batches prompts with its running answers and keeps its own prefix cache.
        `clock`: what times the bursts after a prompt decode prefilled (`_decode_prefills`)."""
        self.planner = planner
        self.renderer = renderer
        self.seal = seal
        self.kv_connector = kv_connector  # where a prefill leg publishes KV for another server
        self.observer = observer
        self.speller = TokenSpeller(renderer.tokenizer)
        self.render_rate = render_rate or RenderRate.calibrate(self._render_ids)
        self.stall_timeout_s = stall_timeout_s  # longest wait for decode's next response
        self.render_max_chars = render_max_chars
        self.decode_load = decode_load
        self.local_prefill_when_idle = local_prefill_when_idle
        self.decode_prefills_all = decode_prefills_all
        self.clock = clock
        self._local: tuple[float, np.ndarray] | None = None  # when decode last took a plain prompt, and its ids
        self._serving = 0  # requests inside `serve` now

    @classmethod
    def for_model(
        cls,
        model_dir: Path,
        served_name: str | Sequence[str],
        parameters: dict[str, str],
        observer: HandoffObserver,
        environ: Mapping[str, str] | None = None,
    ) -> ChatFlow:
        """The flow as a server's settings configure it (gate policy, handoff key and TTL,
        connector; `environ`: the process environment unless given); the renderer here
        renders short requests, checks sizes, spells prefill's first token and calibrates
        the render rate."""
        env = os.environ if environ is None else environ
        load_xgrammar()  # requests are parsed on chat's event loop: no import there
        renderer = load_renderer(model_dir, served_name, parameters)
        gate = Gate(
            policy=parse_policy(forwarded_ids_policy(parameters, env)),
            key=load_key(env),
            vocab_size=len(renderer.tokenizer),
            context_length=renderer.context_length,
        )
        planner = RoutePlanner(gate, served_name, handoff_ttl_s(parameters, env), renderer.render_defaults)
        seal = StageSeal.for_this_server(env)
        stall_timeout_s = STAGE_STALL_TIMEOUT_S.get(parameters, env)
        return cls(
            planner,
            renderer,
            seal,
            kv_connector(parameters, env),
            observer,
            stall_timeout_s=stall_timeout_s,
            render_max_chars=CHAT_RENDER_MAX_CHARS.get(parameters, env),
            decode_load=DecodeLoad(server_directory(os.getppid())),
            local_prefill_when_idle=LOCAL_PREFILL_WHEN_IDLE.get(parameters, env),
            decode_prefills_all=ENGINE.get(parameters, env) == "vllm",
        )

    async def serve(self, inputs: ChatInputs, stages: ChatStages) -> None:
        """Serve one request through `stages`, to its client's last response.

        Raises what refuses the request before anything was sent (InvalidRequest and its
        kinds, stage errors); the caller sends it as the client's error."""
        self._serving += 1
        try:
            await self._serve(inputs, stages)
        finally:
            self._serving -= 1

    async def _serve(self, inputs: ChatInputs, stages: ChatStages) -> None:
        plan = self._plan(inputs)
        stages.routed(plan.route)
        chat = plan.chat
        if plan.route is Route.REUSE:
            with plan.admission as admission:  # the handoff: spent once decode takes the request, else released
                self.observer.accepted(self.render_rate.estimate(len(plan.prompt_token_ids)))
                params_text = plan.generation.to_json()
                handle = "" if admission.kv_handle is None else admission.kv_handle.to_json()
                seal = self.seal.seal_prompt(plan.prompt_token_ids, params_text, handle)
                sent = bool(handle) and stages.has_first_output()  # the first token is the handle's
                call = DecodeCall(
                    plan.prompt_token_ids, plan.generation, params_text, seal, handle, first_output_sent=sent
                )
                await self._relay(stages, call, taken=admission.spend)
            return
        rendered = await self._render(chat, stages)
        self.render_rate.observe(rendered.render_s, len(rendered.prompt_token_ids))
        ids, params_text = rendered.prompt_token_ids, rendered.params_text
        params = GenerationParams.from_json(params_text)
        if plan.route is Route.RENDER_VERIFIED:
            with self.planner.admit_rendered(plan, ids) as admission:  # spent once decode takes the request
                handle = "" if admission.kv_handle is None else admission.kv_handle.to_json()
                seal = self.seal.seal_prompt(ids, params_text, handle)
                await self._relay(stages, DecodeCall(ids, params, params_text, seal, handle), taken=admission.spend)
        elif plan.route is Route.REMOTE_PREFILL:
            prefilled = await stages.prefill(rendered, self.kv_connector, first_output=stages.wants_first_output())
            _send_first_output(stages, prefilled)  # the client's, before the decode leg starts
            kv_handle = KVHandle.from_json(prefilled.kv_handle)  # signed into the handoff, first token shown
            handoff = self.planner.sign_handoff(chat, ids, kv_handle=kv_handle, answer=params)
            first = self._first_delta(kv_handle)
            stages.answer(
                remote_prefill_output(params, ids.tolist(), first, self.speller, handoff.to_params()), handoff.to_json()
            )
        elif self._decode_prefills(ids):  # no KV to hand over
            await self._relay(stages, DecodeCall(ids, params, params_text, self.seal.seal_prompt(ids, params_text)))
        else:
            early = self.decode_load is None or self.decode_load.has_room(len(ids) + params.max_tokens)
            prefilled = await stages.prefill(rendered, SHM, first_output=early)
            sent = _send_first_output(stages, prefilled)  # the client has it before decode starts
            call = DecodeCall(ids, params, params_text, prefilled.seal, prefilled.kv_handle, first_output_sent=sent)
            await self._relay(stages, call)

    async def _render(self, chat: ChatRequest, stages: ChatStages) -> Rendered:
        """`chat` rendered and sealed for prefill and decode: here when it is short
        (`render_max_chars`) and has no chat_template of its own, so its first token skips
        the renderer's round trip; else by the renderer model.

        NOTE: a render here runs on chat's event loop, unbounded in time: only the server's
        own template, over a bounded text. A request's template, or a long text, goes to
        the renderer, which bounds each render (render_timeout_s) beside chat's work."""
        chars = self.renderer.check_size(chat)  # before any render, or the text crossing to the renderer
        here = 0 < self.render_max_chars and chars <= self.render_max_chars
        if not here or REQUEST_TEMPLATE in chat.chat_template_kwargs:
            request_json = chat.to_json()
            return await stages.render(request_json, self.seal.seal_request(request_json))
        started = time.perf_counter()
        prompt = self.renderer.render(chat)
        ids = np.asarray(prompt.prompt_token_ids, dtype=np.int32)
        params_text = prompt.params.to_json()
        rendered = Rendered(ids, params_text, self.seal.seal_prompt(ids, params_text), time.perf_counter() - started)
        self.observer.rendered()
        return rendered

    def _decode_prefills(self, ids: np.ndarray) -> bool:
        """Whether decode prefills this plain prompt itself: decode holds no sequence
        (`decode_load`) and no other request is inside `serve` here. Requests served
        together (a burst) go to prefill, which computes them beside decode's work: decode
        would prefill them in turn on one core, each waiting for the one before.

        NOTE: within LOCAL_BURST_S of a prompt decode took, decode's count may not show it
        yet. A prompt then goes to decode only if it is that very prompt (the n choices of
        one request, each started once the one before answered): decode holds its blocks,
        so it computes a block's tail of it; any other goes to prefill."""
        if self.decode_prefills_all:
            return True
        if not self.local_prefill_when_idle or self.decode_load is None:
            return False
        now = self.clock()
        if self._local is not None and now - self._local[0] < LOCAL_BURST_S:
            same = np.array_equal(ids, self._local[1])
            if same:
                self._local = (now, self._local[1])
            return same
        if self._serving > 1 or not self.decode_load.idle():
            return False
        self._local = (now, ids)
        return True

    def _plan(self, inputs: ChatInputs):
        try:
            return self.planner.plan(inputs.chat, inputs.prompt_token_ids, inputs.kv_transfer_params)
        except ForwardedIdsRejected as exc:
            self.observer.rejected(exc.reason.value)
            raise

    async def _relay(self, stages: ChatStages, call: DecodeCall, taken: Callable[[], None] | None = None) -> None:
        """Forward decode's stream to the client, to its end; `taken` is called on decode's
        first response unless that is a refusal (decode took the request). A client that
        asked for a ticket gets `call` instead (with the grant of the decode feed it asked
        for), and `taken` is called once it is sent.

        Past `stall_timeout_s` without a response from decode (before its first, or between
        two), decode is told to cancel and the request ends Unavailable, naming the wait.

        NOTE: once the client left, decode is told to cancel and its stream is drained, not
        dropped: the stream ends when decode ends it, so nothing of it outlives the request."""
        if stages.wants_ticket():
            feed = stages.feed_to_grant()
            stages.ticket(call, None if feed is None else self.seal.seal_feed(feed))
            if taken is not None:
                taken()  # NOTE: the seal on `call` opens decode once: the ticket cannot spend it twice
            return
        closed = cancelled = False
        polled_at = float("-inf")
        # NOTE: a whole answer has no response until its end: decode's empty ones keep it inside the deadline.
        call = replace(call, heartbeat_s=self.stall_timeout_s / 3)
        responses = stages.decode(call) if taken is None else _noting_taken(stages, call, taken)
        while True:
            waiting = asyncio.ensure_future(anext(responses))
            silent_until = time.monotonic() + self.stall_timeout_s
            # A whole answer has no response for long: its client is looked for meanwhile too.
            while not (await asyncio.wait({waiting}, timeout=min(IDLE_POLL_S, self.stall_timeout_s)))[0]:
                if not (closed or cancelled) and stages.client_left():
                    cancelled = True
                    await self._cancel(stages, call.params.request_id)
                if time.monotonic() >= silent_until:
                    break
            if not waiting.done():
                waiting.cancel()
                if closed or cancelled:
                    return  # its client has all it will get: stop draining
                await self._cancel(stages, call.params.request_id)
                raise Unavailable(
                    f"decode sent nothing for {self.stall_timeout_s:g} s (setting stage_stall_timeout_s); "
                    "the request was cancelled"
                )
            try:
                response = waiting.result()
            except StopAsyncIteration:
                break
            if closed or cancelled:
                continue
            if time.monotonic() - polled_at >= CANCEL_POLL_S:
                polled_at = time.monotonic()
                if stages.client_left():
                    cancelled = True
                    await self._cancel(stages, call.params.request_id)
                    continue
            closed = stages.relay(response)
        if not closed:
            stages.close()

    async def _cancel(self, stages: ChatStages, request_id: str) -> None:
        """Tell decode to stop `request_id`, waiting at most `stall_timeout_s` for it to confirm."""
        try:
            await asyncio.wait_for(stages.cancel(request_id, self.seal.seal_cancel(request_id)), self.stall_timeout_s)
        except asyncio.TimeoutError:
            pass  # a decode that does not answer has nothing running to stop

    def _first_delta(self, handle: KVHandle) -> Delta:
        """Prefill's first token as the prefill leg's answer shows it."""
        token, logprobs = handle.first_token_id, handle.first_token_logprobs
        text = self.renderer.tokenizer.decode([token], skip_special_tokens=True)
        return Delta(text, [token], None, [] if logprobs is None else [logprobs], handle.cached_tokens)

    def _render_ids(self, messages: list[dict]) -> list[int]:
        return self.renderer.token_ids(ChatRequest(messages=messages))


def _send_first_output(stages: ChatStages, prefilled: Prefilled) -> bool:
    """Send prefill's first output to the client, if it made one; whether it did."""
    if prefilled.first_output is None:
        return False
    stages.send(prefilled.first_output)
    return True


async def _noting_taken(stages: ChatStages, call: DecodeCall, taken: Callable[[], None]) -> AsyncIterator[Any]:
    """Decode's responses to `call`; `taken` is called before the first unless decode refused the request."""
    first = True
    async for response in stages.decode(call):
        if first and not stages.refused(response):
            taken()
        first = False
        yield response
