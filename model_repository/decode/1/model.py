"""decode (decoupled): prompt ids + prefill's KV and first token -> streamed answer.

Without KV it prefills locally. Requests are decoded on one scheduler thread, a
token each in turn; execute() only validates and queues. A request carrying only
`cancel_request_id` stops the named request instead.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.generation import TextModel
from pdchat.core.scheduler import DecodeJob, DecodeScheduler
from pdchat.core.settings import resolve_model
from pdchat.triton import io
from pdchat.triton.metrics import DecodeMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        settings = resolve_model(io.model_parameters(args))
        self.model = TextModel(settings.path, settings.device)
        self.scheduler = DecodeScheduler()
        self.metrics = DecodeMetrics(args["model_name"])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            cancel = io.input_text(request, tensors.CANCEL_REQUEST_ID)
            if cancel is not None:
                self.scheduler.cancel(cancel)
                sender.send(flags=FINAL)
                continue
            try:
                job = self._job(request, sender)
            except Exception as exc:  # noqa: BLE001
                sender.send(io.error_response(exc), flags=FINAL)
                continue
            self.metrics.started()
            self.scheduler.submit(job)
        return None

    def finalize(self):
        self.scheduler.close()
        self.metrics.close()

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
            if delta.finish_reason:
                self.metrics.ended("finished")

        def fail(exc):
            sender.send(io.error_response(exc), flags=FINAL)
            self.metrics.ended("failed")

        def on_cancel():
            sender.send(flags=FINAL)
            self.metrics.ended("cancelled")

        return DecodeJob(
            key=params.request_id,
            start=lambda: self.model.generation(ids, params, first_token_id=first, kv_cache=kv),
            emit=emit,
            fail=fail,
            is_cancelled=sender.is_cancelled,
            on_cancel=on_cancel,
        )
