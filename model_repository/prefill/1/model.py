"""prefill: prompt token ids -> first output token + the prompt's KV cache.

The KV goes back as a tensor (one server), or, when the request names a
`kv_destination` connector, is published there for a decode server and only its
handle goes back.
"""

import json

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.generation import TextModel
from pdchat.core.kv_transfer import Connectors
from pdchat.core.settings import kv_options, resolve_model
from pdchat.triton import io
from pdchat.triton.metrics import KVHeldMetrics


class TritonPythonModel:
    def initialize(self, args):
        parameters = io.model_parameters(args)
        settings = resolve_model(parameters)
        self.model = TextModel(settings.path, settings.device)
        self.metrics = KVHeldMetrics(args["model_name"])
        self.connectors = Connectors(on_sweep=self.metrics.update, **kv_options(parameters))

    def execute(self, requests):
        return [self._prefill(request) for request in requests]

    def finalize(self):
        self.connectors.close()
        self.metrics.close()

    def _prefill(self, request):
        try:
            ids = io.required_token_ids(request)
            destination = io.input_text(request, tensors.KV_DESTINATION)
            token, kv = self.model.prefill(ids, io.generation_params(request))
            first = io.int32_tensor(tensors.FIRST_TOKEN_ID, [token])
            if destination is None:
                return pb_utils.InferenceResponse(output_tensors=[first, pb_utils.Tensor(tensors.KV_CACHE, kv)])
            handle = self.connectors.get(destination).publish(kv, {"first_token_id": token})
        except Exception as exc:  # noqa: BLE001 - KVBudgetExceeded becomes UNAVAILABLE
            return io.error_response(exc)
        return pb_utils.InferenceResponse(output_tensors=[first, io.string_tensor(tensors.KV_HANDLE, json.dumps(handle))])
