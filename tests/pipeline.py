"""renderer -> prefill -> decode in one process: chat_ensemble without a server."""

from __future__ import annotations

from pathlib import Path

from pdchat.core.generation.generation import TextModel
from pdchat.core.output.responses import ClientOutput
from pdchat.core.request.protocol import ChatRequest
from pdchat.core.request.rendering import ChatRenderer


class LocalPipeline:
    def __init__(self, model_dir: Path, device: str = "cpu"):
        self.renderer = ChatRenderer(model_dir, model_dir.name)
        self.model = TextModel(model_dir, device)

    def run(self, request: ChatRequest, *, handoff: bool = True) -> list[ClientOutput]:
        """Every output the client would receive. `handoff`: decode starts from prefill's
        exported KV and first token, as across models; else decode prefills itself."""
        rendered = self.renderer.render(request)
        ids, params = rendered.prompt_token_ids, rendered.params
        handed = {}
        if handoff:
            token, kv = self.model.prefill(ids, params)
            handed = {"first_token_id": token, "kv_cache": kv}
        generation = self.model.generation(ids, params, **handed)
        assembler = self.model.assembler(ids, params)
        outputs = []
        while True:
            delta = generation.advance()
            outputs += assembler.on_delta(delta)
            if delta.finish_reason:
                return outputs
