"""`chat` without a server: the same `ChatFlow` as the chat model, over an in-process executor.

`LocalStages` is `ChatStages` in one process: the stage models' core calls (render, prefill,
decode), their seals checked as the stage models check them, KV handed over through a real
shm connector. Decode runs a request alone (`Generation.advance`), or in one batch with
others through decode's scheduler (`LocalPipeline.run_batched`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from pdchat.core.generation.engine import DecodeBatch
from pdchat.core.generation.generation import Generation, TextModel
from pdchat.core.generation.sampling import Choice
from pdchat.core.generation.scheduler import DecodeJob, DecodeScheduler
from pdchat.core.kv.base import KVHandle
from pdchat.core.kv.connector import Connectors
from pdchat.core.output.responses import FAILED, ClientOutput, Delta
from pdchat.core.request.protocol import ChatRequest, GenerationParams
from pdchat.ensemble.flow import ChatFlow, ChatInputs, DecodeCall, Prefilled, Rendered
from pdchat.ensemble.routing import Route

_END = object()


class CountingObserver:
    """The gate's outcomes and chat's own renders, counted."""

    def __init__(self) -> None:
        self.accepted_count = 0
        self.rejections: list[str] = []
        self.rendered_count = 0

    def accepted(self, seconds_saved: float) -> None:
        self.accepted_count += 1

    def rejected(self, reason: str) -> None:
        self.rejections.append(reason)

    def rendered(self) -> None:
        self.rendered_count += 1


class LocalPipeline:
    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        parameters: dict[str, str] | None = None,
        environ: dict[str, str] | None = None,
    ):
        """`parameters` and `environ`: the chat model's settings (none by default: gate off, no key)."""
        self.observer = CountingObserver()
        self.flow = ChatFlow.for_model(model_dir, model_dir.name, parameters or {}, self.observer, environ or {})
        self.renderer = self.flow.renderer
        self.model = TextModel(model_dir, device)
        self.connectors = Connectors()
        self._model_dir = model_dir

    @functools.cached_property
    def reference_model(self):
        """transformers' own model of the same weights, with its own attention and cache."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=self.model.engine.dtype).eval()

    def run(self, request: ChatRequest, *, handoff: bool = True) -> list[ClientOutput]:
        """Every output the client would receive. `handoff`: decode starts from prefill's
        exported KV and first token, as across models; else decode prefills itself."""
        return self.serve(ChatInputs(request), handoff=handoff).outputs

    def serve(self, inputs: ChatInputs, *, handoff: bool = True) -> LocalStages:
        """Serve `inputs` as the chat model would; the stages hold what the client got."""
        stages = LocalStages(self, handoff)
        asyncio.run(self.flow.serve(inputs, stages))
        return stages

    def run_batched(self, requests: list[ChatRequest], timeout: float = 120.0) -> list[list[ClientOutput]]:
        """Every request's outputs, decoded together in one batch by decode's scheduler."""
        scheduler = DecodeScheduler(DecodeBatch(self.model.engine))
        stages = [LocalStages(self, handoff=True, scheduler=scheduler) for _ in requests]

        async def serve_all() -> None:
            served = (
                self.flow.serve(ChatInputs(request), stage) for request, stage in zip(requests, stages, strict=True)
            )
            await asyncio.wait_for(asyncio.gather(*served), timeout)

        try:
            asyncio.run(serve_all())
        finally:
            scheduler.close()
        return [stage.outputs for stage in stages]


class LocalStages:
    """`ChatStages` in this process, for one request; its client's outputs land in `outputs`."""

    def __init__(self, pipeline: LocalPipeline, handoff: bool, scheduler: DecodeScheduler | None = None):
        self.pipeline = pipeline
        self.seal = pipeline.flow.seal
        self.handoff = handoff  # False: prefill publishes no KV, so decode prefills itself
        self.scheduler = scheduler
        self.route: Route | None = None
        self.outputs: list[ClientOutput] = []
        self.kv_transfer_params: str | None = None
        self.closed = False
        self.ticketed = False  # True: the client asks for tickets (tensors.DECODE_TICKET)
        self.sent: list[ClientOutput] = []  # outputs chat sent itself (prefill's first output)
        self.first_output_early = False  # a prefill leg's caller asks for the first output
        self.first_output_sent = False  # a decode leg's caller has it
        self.tickets: list[DecodeCall] = []
        self.feed_grant: str | None = None  # the decode feed a ticketed client asks a grant for
        self.feed_seals: list[str | None] = []  # the grant sent with each ticket

    def routed(self, route: Route) -> None:
        self.route = route

    async def render(self, request_json: str, seal: str) -> Rendered:
        self.seal.check_request(request_json, seal)
        rendered = self.pipeline.renderer.render(ChatRequest.from_json(request_json))
        ids, params = rendered.prompt_token_ids, rendered.params.to_json()
        return Rendered(np.asarray(ids, dtype=np.int32), params, self.seal.seal_prompt(ids, params), 0.0)

    async def prefill(self, rendered: Rendered, destination: str, first_output: bool) -> Prefilled:
        ids, params_text = rendered.prompt_token_ids.tolist(), rendered.params_text
        self.seal.check_prompt(ids, params_text, "", rendered.seal)
        handle, shown = "", None
        if self.handoff:
            params = GenerationParams.from_json(params_text)
            prefilled = self.pipeline.model.prefill(ids, params)
            handle = self.pipeline.connectors.publish(
                destination, prefilled.kv, prefilled.first.token_id, prefilled.first.logprobs, prefilled.cached_tokens
            ).to_json()
            if first_output:
                shown = self.pipeline.model.first_output(ids, params, prefilled.first, prefilled.cached_tokens)
        return Prefilled(handle, self.seal.seal_prompt(ids, params_text, handle), shown)

    def send(self, output: ClientOutput) -> None:
        self.outputs.append(output)
        self.sent.append(output)

    async def decode(self, call: DecodeCall) -> AsyncIterator[ClientOutput]:
        ids = np.asarray(call.prompt_token_ids).tolist()
        self.seal.check_prompt(ids, call.params_text, call.kv_handle, call.seal)
        generation = self._generation(ids, call.params, call.kv_handle)
        assembler = self.pipeline.model.assembler(ids, call.params, first_output_sent=call.first_output_sent)
        deltas = _advance(generation) if self.scheduler is None else self._batched(call.params.request_id, generation)
        async for delta in deltas:
            for output in assembler.on_delta(delta):
                yield output

    def relay(self, response: ClientOutput) -> bool:
        self.outputs.append(response)
        return response.final

    def refused(self, response: ClientOutput) -> bool:
        return response.finish_reason == FAILED

    def answer(self, output: ClientOutput, kv_transfer_params: str) -> None:
        self.outputs.append(output)
        self.kv_transfer_params = kv_transfer_params

    def wants_ticket(self) -> bool:
        return self.ticketed

    def wants_first_output(self) -> bool:
        return self.first_output_early

    def has_first_output(self) -> bool:
        return self.first_output_sent

    def feed_to_grant(self) -> str | None:
        return self.feed_grant

    def ticket(self, call: DecodeCall, feed_seal: str | None) -> None:
        self.tickets.append(call)
        self.feed_seals.append(feed_seal)

    def close(self) -> None:
        self.closed = True

    def client_left(self) -> bool:
        return False

    async def cancel(self, request_id: str, seal: str) -> None:
        self.seal.check_cancel(request_id, seal)
        if self.scheduler is not None:
            self.scheduler.cancel(request_id)

    def _generation(self, ids: list[int], params: GenerationParams, handle_text: str) -> Generation:
        if not handle_text:
            return self.pipeline.model.generation(ids, params)
        handle = KVHandle.from_json(handle_text)
        connectors = self.pipeline.connectors
        return self.pipeline.model.generation(
            ids,
            params,
            first=Choice(handle.first_token_id, handle.first_token_logprobs),
            kv_source=lambda start: connectors.pull(handle, start),
            on_kv_released=lambda: connectors.done(handle),
            cached_tokens=handle.cached_tokens,
        )

    async def _batched(self, key: str, generation: Generation) -> AsyncIterator[Delta]:
        """The deltas of `generation`, stepped in decode's scheduler with the batch's other rows."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue = asyncio.Queue()
        put = arrived.put_nowait

        def emit(delta: Delta) -> None:
            loop.call_soon_threadsafe(put, delta)
            if delta.finish_reason:
                loop.call_soon_threadsafe(put, _END)

        def fail(exc: Exception) -> None:
            loop.call_soon_threadsafe(put, exc)

        assert self.scheduler is not None
        self.scheduler.submit(
            DecodeJob(
                key=key,
                start=lambda: generation,
                emit=emit,
                fail=fail,
                on_cancel=lambda: loop.call_soon_threadsafe(put, _END),
            )
        )
        while (item := await arrived.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item


async def _advance(generation: Generation) -> AsyncIterator[Delta]:
    """The deltas of `generation` stepped alone, to its end."""
    while True:
        delta = generation.advance()
        yield delta
        if delta.finish_reason:
            return
