"""prefill: sealed prompt token ids -> first output token + the prompt's KV cache.

The KV goes back as a tensor with the first token and its logprobs (one server), or, when
the request names a `kv_destination` connector, is published there for a decode server
and only its handle goes back, carrying the first token and its logprobs.
"""

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.generation.generation import TextModel
from pdchat.core.kv.connector import Connectors
from pdchat.core.settings import compile_options, kv_options, kv_pool_options
from pdchat.ensemble.seal import StageSeal
from pdchat.models import resolve_model
from pdchat.registry import SHM
from pdchat.triton import io
from pdchat.triton.metrics import KVHeldMetrics, KVPoolMetrics
from pdchat.triton.server_watch import exit_with_server


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        settings = resolve_model(parameters).on_instance(*io.instance_placement(args))
        self.model = TextModel(
            settings.path,
            settings.device,
            settings.dtype,
            settings.threads,
            compile_options(parameters),
            kv_pool_options("prefill", parameters),
        )
        self.model.constraints.start()  # its grammar worker, before a request with a grammar waits for it
        self.seal = StageSeal.for_this_server()
        self.metrics = KVHeldMetrics(args["model_name"], args["model_instance_name"])
        self.pool_metrics = KVPoolMetrics(args["model_name"], args["model_instance_name"])
        self.connectors = Connectors(on_sweep=self.metrics.update, **kv_options(parameters))

    def execute(self, requests):
        responses = [self._prefill(request) for request in requests]
        self.pool_metrics.update(self.model.engine.pool.usage())
        return responses

    def finalize(self):
        self.model.close()
        self.connectors.close()
        self.metrics.close()
        self.pool_metrics.close()

    def _prefill(self, request):
        try:
            engine = self.model.engine
            stage = io.stage_input(request, self.seal, engine.context_length, engine.vocab_size)
            destination = io.input_text(request, tensors.KV_DESTINATION) or SHM
            prefilled = self.model.prefill(stage.prompt_token_ids, stage.params)
            handle = self.connectors.publish(
                destination, prefilled.kv, prefilled.first.token_id, prefilled.first.logprobs, prefilled.cached_tokens
            ).to_json()
        except Exception as exc:  # noqa: BLE001 - KVBudgetExceeded becomes UNAVAILABLE
            return io.error_response(exc)
        # Decode takes this KV only with prefill's seal over it and the prompt it belongs to.
        seal = self.seal.seal_prompt(stage.prompt_token_ids, stage.params_text, handle)
        return pb_utils.InferenceResponse(
            output_tensors=[
                io.int32_tensor(tensors.FIRST_TOKEN_ID, [prefilled.first.token_id]),
                io.string_tensor(tensors.KV_HANDLE, handle),
                io.string_tensor(tensors.STAGE_SEAL, seal),
            ]
        )
