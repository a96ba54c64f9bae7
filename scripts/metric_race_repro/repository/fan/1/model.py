"""fan (decoupled BLS): serves each request on a worker thread that streams leaf's answer.

Shaped like pdchat's old chat model: execute() submits every request to a 64-thread
pool; each worker logs, increments three counters, calls leaf with
exec(decoupled=True), and forwards each response (checking is_cancelled() first).

BLS_REPRO_FAN (environment of tritonserver; bls_repro.py sets it):
  old  - workers call increment() on the same three pb_utils Metric objects at once.
  safe - the same, but each increment() is taken under one lock. Everything else
         (64 threads sending, is_cancelled, Logger, decoupled BLS) stays concurrent.

Why it matters (python_backend r24.10, src/metric.cc): Metric.increment() releases
the GIL and then SaveToSharedMemory() overwrites the Metric's own shm members
(custom_metric_shm_, labels_shm_, shm_handle_) with no lock. Two threads on one Metric
free each other's shm blocks while the server is still reading them; the server's
StubToParentMQMonitor thread then frees a stale label string in ~Metric and
crashes (SIGSEGV in rbtree_best_fit::priv_deallocate).
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PATTERN = os.environ.get("BLS_REPRO_FAN", "old")
OUTPUTS = ["text_output", "response", "prompt_token_ids", "output_token_ids", "finish_reason"]


class TritonPythonModel:
    def initialize(self, args):
        self.families = [
            pb_utils.MetricFamily(
                name=f"bls_repro_fan_{name}_total", description=name, kind=pb_utils.MetricFamily.COUNTER
            )
            for name in ("requests", "renders_skipped", "seconds_saved")
        ]
        self.counters = [family.Metric(labels={"model": "fan"}) for family in self.families]
        self.metrics_lock = threading.Lock()
        self.workers = ThreadPoolExecutor(64, thread_name_prefix="fan")

    def execute(self, requests):
        for request in requests:
            self.workers.submit(self._serve, request, request.get_response_sender())
        return None

    def finalize(self):
        self.workers.shutdown(wait=True, cancel_futures=True)
        self.counters.clear()  # metrics before their families
        self.families.clear()

    def _count(self):
        for counter, value in zip(self.counters, (1, 1, 0.001), strict=True):
            if PATTERN == "old":
                counter.increment(value)
            else:
                with self.metrics_lock:
                    counter.increment(value)

    def _serve(self, request, sender):
        try:
            pb_utils.Logger.log_info(f"fan request {request.request_id() or '-'}")
            self._count()
            n = pb_utils.get_input_tensor_by_name(request, "n")
            stage = pb_utils.InferenceRequest(
                model_name="leaf", inputs=[pb_utils.Tensor("n", n.as_numpy())], requested_output_names=OUTPUTS
            )
            finished = False
            for response in stage.exec(decoupled=True):
                if sender.is_cancelled():
                    continue  # drain; the client is gone
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()), flags=FINAL)
                    return
                if not response.output_tensors():
                    continue  # leaf's bare final flag
                finish = pb_utils.get_output_tensor_by_name(response, "finish_reason").as_numpy()[0]
                finished = bool(finish)
                sender.send(
                    pb_utils.InferenceResponse(output_tensors=response.output_tensors()), flags=FINAL if finished else 0
                )
            if not finished:
                sender.send(flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its client
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")), flags=FINAL
            )
