"""decode (decoupled): prompt ids + prefill's KV and first token -> streamed answer.

Without KV it prefills locally. Requests are decoded on one scheduler thread, a
token each in turn; execute() only validates and queues.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.generation import TextModel
from pdchat.core.scheduler import DecodeJob, DecodeScheduler
from pdchat.core.settings import resolve_model
from pdchat.triton import io

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        settings = resolve_model(io.model_parameters(args))
        self.model = TextModel(settings.path, settings.device)
        self.scheduler = DecodeScheduler()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._job(request, sender)
            except Exception as exc:  # noqa: BLE001
                sender.send(io.error_response(exc), flags=FINAL)
                continue
            self.scheduler.submit(job)
        return None

    def finalize(self):
        self.scheduler.close()

    def _job(self, request, sender) -> DecodeJob:
        ids = io.required_token_ids(request)
        params = io.generation_params(request)
        kv = io.input_array(request, tensors.KV_CACHE)
        first = io.input_scalar(request, tensors.FIRST_TOKEN_ID)
        # Own the KV: the request's input buffers are not ours once execute() returns.
        kv = None if kv is None else np.array(kv, dtype=np.float32, copy=True)
        assembler = self.model.assembler(ids, params)

        def emit(delta):
            output = assembler.on_delta(delta)
            if output is not None:
                sender.send(io.client_response(output), flags=FINAL if output.final else 0)

        return DecodeJob(
            start=lambda: self.model.generation(ids, params, first_token_id=first, kv_cache=kv),
            emit=emit,
            fail=lambda exc: sender.send(io.error_response(exc), flags=FINAL),
            is_cancelled=sender.is_cancelled,
            on_cancel=lambda: sender.send(flags=FINAL),
        )
