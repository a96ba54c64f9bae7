"""prefill: prompt token ids -> KV cache + first output token."""

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.generation import TextModel
from pdchat.core.settings import resolve_model
from pdchat.triton import io


class TritonPythonModel:
    def initialize(self, args):
        settings = resolve_model(io.model_parameters(args))
        self.model = TextModel(settings.path, settings.device)

    def execute(self, requests):
        return [self._prefill(request) for request in requests]

    def _prefill(self, request):
        try:
            ids = io.required_token_ids(request)
            token, kv = self.model.prefill(ids, io.generation_params(request))
        except Exception as exc:  # noqa: BLE001
            return io.error_response(exc)
        return pb_utils.InferenceResponse(
            output_tensors=[io.int32_tensor(tensors.FIRST_TOKEN_ID, [token]), pb_utils.Tensor(tensors.KV_CACHE, kv)]
        )
