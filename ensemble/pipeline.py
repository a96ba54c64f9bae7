"""renderer -> prefill -> decode in one process: chat_ensemble without a server."""

from __future__ import annotations

from pathlib import Path

from pdchat.core.engine import CausalLM
from pdchat.core.generation import Generation, eos_token_ids, prefill_for_handoff
from pdchat.core.protocol import ChatRequest
from pdchat.core.rendering import ChatRenderer
from pdchat.core.responses import ClientOutput, ResponseAssembler


class LocalPipeline:
    def __init__(self, model_dir: Path, device: str = "cpu"):
        self.renderer = ChatRenderer(model_dir, model_dir.name)
        self.engine = CausalLM(model_dir, device)
        self.eos_ids = eos_token_ids(self.engine, self.renderer.tokenizer)

    def run(self, request: ChatRequest, *, handoff: bool = True) -> list[ClientOutput]:
        """Every output the client would receive. `handoff`: decode starts from prefill's
        exported KV and first token, as across models; else decode prefills itself."""
        rendered = self.renderer.render(request)
        ids, params = rendered.prompt_token_ids, rendered.params
        handed = {}
        if handoff:
            token, kv = prefill_for_handoff(self.engine, ids, params)
            handed = {"first_token_id": token, "kv_cache": kv}
        generation = Generation(self.engine, self.renderer.tokenizer, self.eos_ids, ids, params, **handed)
        assembler = ResponseAssembler(params, ids)
        outputs = []
        while True:
            delta = generation.advance()
            output = assembler.on_delta(delta)
            if output is not None:
                outputs.append(output)
            if delta.finish_reason:
                return outputs
