"""leaf (decoupled): streams `n` responses per request from one scheduler thread.

Shaped like pdchat's old decode model: execute() only queues; a scheduler thread emits
one 5-tensor response per step, round-robin over its active requests. A gauge counts
requests in progress.

BLS_REPRO_LEAF (environment of tritonserver; bls_repro.py sets it):
  old  - the gauge goes +1 in execute() (Triton's thread) and -1 on the scheduler
         thread: two threads call increment() on the same pb_utils Metric.
  safe - both increments happen on the scheduler thread.
"""

import os
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PATTERN = os.environ.get("BLS_REPRO_LEAF", "old")


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(
            name="bls_repro_leaf_active", description="leaf requests in progress", kind=pb_utils.MetricFamily.GAUGE
        )
        self.active = self.family.Metric(labels={"model": "leaf"})
        self.incoming = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="leaf-scheduler", daemon=True)
        self.thread.start()

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "n").as_numpy()[0])
            if PATTERN == "old":
                self.active.increment(1)  # Triton's thread, racing the scheduler's -1
            self.incoming.put((request.get_response_sender(), n))
        return None

    def finalize(self):
        self.incoming.put(None)
        self.thread.join(10)
        del self.active, self.family  # metrics before their family

    def _run(self):
        active = []  # [sender, steps left, step]
        while True:
            block = not active
            try:
                while True:
                    job = self.incoming.get(block=block)
                    block = False
                    if job is None:
                        return
                    if PATTERN != "old":
                        self.active.increment(1)
                    active.append([job[0], job[1], 0])
            except queue.Empty:
                pass
            for job in list(active):
                sender, left, step = job
                final = left <= 1
                sender.send(_response(step, final), flags=FINAL if final else 0)
                job[1], job[2] = left - 1, step + 1
                if final:
                    active.remove(job)
                    self.active.increment(-1)


def _response(step, final):
    def text(name, value):
        return pb_utils.Tensor(name, np.array([value.encode()], dtype=np.object_))

    return pb_utils.InferenceResponse(
        output_tensors=[
            text("text_output", f"t{step}"),
            text("response", f'{{"delta": "t{step}"}}'),
            pb_utils.Tensor("prompt_token_ids", np.arange(8, dtype=np.int32)),
            pb_utils.Tensor("output_token_ids", np.array([step], dtype=np.int32)),
            text("finish_reason", "length" if final else ""),
        ]
    )
