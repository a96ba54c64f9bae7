"""renderer -> prefill -> decode in one process: chat_ensemble without a server."""

from __future__ import annotations

import threading
from pathlib import Path

from pdchat.core.generation.engine import DecodeBatch
from pdchat.core.generation.generation import Generation, TextModel
from pdchat.core.generation.scheduler import DecodeJob, DecodeScheduler
from pdchat.core.output.responses import ClientOutput, ResponseAssembler
from pdchat.core.request.protocol import ChatRequest
from pdchat.core.request.renderers import load_renderer


class LocalPipeline:
    def __init__(self, model_dir: Path, device: str = "cpu"):
        self.renderer = load_renderer(model_dir, model_dir.name)
        self.model = TextModel(model_dir, device)

    def run(self, request: ChatRequest, *, handoff: bool = True) -> list[ClientOutput]:
        """Every output the client would receive. `handoff`: decode starts from prefill's
        exported KV and first token, as across models; else decode prefills itself."""
        generation, assembler = self._start(request, handoff)
        outputs = []
        while True:
            delta = generation.advance()
            outputs += assembler.on_delta(delta)
            if delta.finish_reason:
                return outputs

    def run_batched(self, requests: list[ChatRequest], timeout: float = 120.0) -> list[list[ClientOutput]]:
        """Every request's outputs, decoded together in one batch by decode's scheduler."""
        outputs: list[list[ClientOutput]] = [[] for _ in requests]
        ended = [threading.Event() for _ in requests]
        failures: list[Exception] = []
        scheduler = DecodeScheduler(DecodeBatch(self.model.engine))
        for index, request in enumerate(requests):
            generation, assembler = self._start(request, handoff=True)

            def emit(delta, index=index, assembler=assembler):
                outputs[index] += assembler.on_delta(delta)
                if delta.finish_reason:
                    ended[index].set()

            def fail(exc, index=index):
                failures.append(exc)
                ended[index].set()

            scheduler.submit(DecodeJob(key=str(index), start=lambda g=generation: g, emit=emit, fail=fail,
                                       on_cancel=ended[index].set))
        try:
            assert all(event.wait(timeout) for event in ended), "the batch did not finish"
        finally:
            scheduler.close()
        if failures:
            raise failures[0]
        return outputs

    def _start(self, request: ChatRequest, handoff: bool) -> tuple[Generation, ResponseAssembler]:
        rendered = self.renderer.render(request)
        ids, params = rendered.prompt_token_ids, rendered.params
        handed = {}
        if handoff:
            first, kv = self.model.prefill(ids, params)
            handed = {"first": first, "kv_cache": kv}
        return self.model.generation(ids, params, **handed), self.model.assembler(ids, params)
