"""renderer: chat request -> prompt token ids (chat template + tokenizer)."""

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.rendering import ChatRenderer
from pdchat.core.settings import resolve_model
from pdchat.triton import io


class TritonPythonModel:
    def initialize(self, args):
        settings = resolve_model(io.model_parameters(args))
        self.renderer = ChatRenderer(settings.path, settings.served_name)

    def execute(self, requests):
        return [self._render(request) for request in requests]

    def _render(self, request):
        try:
            rendered = self.renderer.render(io.chat_request(request))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its client
            return io.error_response(exc)
        return pb_utils.InferenceResponse(
            output_tensors=[
                io.int32_tensor(tensors.PROMPT_TOKEN_IDS, rendered.prompt_token_ids),
                io.string_tensor(tensors.GENERATION_PARAMS, rendered.params.to_json()),
            ]
        )
