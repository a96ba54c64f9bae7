"""prefill: sealed prompt token ids -> first output token + the prompt's KV cache.

The KV goes back as a tensor with the first token and its logprobs (one server), or, when
the request names a `kv_destination` connector, is published there for a decode server
and only its handle goes back, carrying the first token and its logprobs. Asked for
`first_output`, it also answers a streamed request's first output as decode will make it
(TextModel.first_output), for chat to send before decode starts.

One instance and one KV pool per server, so the prefix cache serves every request: the
engine (core.engine_api; pdchat's computes the prompts a pass at a time on its scheduler's
thread) computes, and execute() only validates and queues. Each answer goes out through the
response sender (one response per request, as a non-decoupled model may) from the outbox thread.
"""

import functools
import logging
import os
import time

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.engine_api import PREFILL, EngineHooks, PrefillRequest
from pdchat.core.engines import open_engine
from pdchat.core.kv.base import engine_kv_handle
from pdchat.core.kv.connector import Connectors
from pdchat.core.settings import cores_in_turns, keep_off_decode_cpus, kv_options
from pdchat.ensemble.core_turns import PassMarks
from pdchat.ensemble.seal import StageSeal, server_directory
from pdchat.models import resolve_model
from pdchat.registry import SHM
from pdchat.triton import io
from pdchat.triton.kv_events import KVEvents
from pdchat.triton.metrics import EngineInfo, KVHeldMetrics, KVPoolMetrics, VllmMetrics
from pdchat.triton.outbox import Outbox
from pdchat.triton.server_watch import exit_with_server, leave_soon

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("pdchat.prefill")


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        keep_off_decode_cpus(parameters)  # decode's scheduler thread runs there alone
        settings = resolve_model(parameters).on_instance(*io.instance_placement(args))
        self.engine = open_engine(PREFILL, settings, parameters, args["model_instance_name"])
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: {self.engine.path.describe()}")
        self.engine_info = EngineInfo(args["model_name"], args["model_instance_name"], self.engine.path)
        self.kv_events = KVEvents("prefill", parameters, args, self.engine.kv_pool)  # off unless its endpoint is set
        self.seal = StageSeal.for_this_server()
        self.metrics = KVHeldMetrics(args["model_name"], args["model_instance_name"])
        self.pool_metrics = KVPoolMetrics(args["model_name"], args["model_instance_name"])
        # vLLM's names
        self.vllm_metrics = VllmMetrics(settings.served_name, args["model_instance_name"], self.engine.context_length)
        options = kv_options(parameters)
        self.kv_ttl_s = options["ttl_s"]
        self.connectors = Connectors(on_sweep=self._on_sweep, **options)
        self.outbox = Outbox("pdchat-prefill-outbox")
        # With prefill_takes_cores_ms, the decodes on these cores wait for the passes it marks.
        self.pass_marks = None
        turns = {}
        if cores_in_turns(parameters):
            self.pass_marks = PassMarks(server_directory(os.getppid()))
            turns = {"pass_began": self.pass_marks.begin, "pass_ended": self.pass_marks.end}
        self.engine.start(EngineHooks(on_dead=leave_soon, **turns))

    def execute(self, requests):
        # NOTE: execute() hands the outbox its calls with post(), which never waits.
        for request in requests:
            sender = request.get_response_sender()
            try:
                engine = self.engine
                stage = io.stage_input(request, self.seal, engine.context_length, engine.vocab_size)
                destination = io.input_text(request, tensors.KV_DESTINATION) or SHM
            except Exception as exc:  # noqa: BLE001
                self.outbox.post(functools.partial(sender.send, io.error_response(exc), flags=FINAL))
                continue
            self.outbox.post(
                functools.partial(self._arrived, stage.params.request_id, time.monotonic(), len(stage.prompt_token_ids))
            )
            self.engine.prefill(
                PrefillRequest(stage.prompt_token_ids, stage.params),
                done=functools.partial(
                    self._done, sender, stage, destination, tensors.FIRST_OUTPUT in request.requested_output_names()
                ),
                fail=functools.partial(self._fail, sender, stage.params.request_id),
            )
        return None

    def finalize(self):
        self.engine.close()
        if self.pass_marks is not None:
            self.pass_marks.close()
        self.kv_events.close()
        self.outbox.close()
        self.engine_info.close()
        self.connectors.close()
        self.metrics.close()
        self.pool_metrics.close()
        self.vllm_metrics.close()

    # On the engine's thread: each hands its work to the outbox.

    def _done(self, sender, stage, destination: str, first_output: bool, prefilled) -> None:
        self.outbox.call(functools.partial(self._answer, sender, stage, destination, first_output, prefilled))
        usage = self.engine.pool_usage()
        self.outbox.call(functools.partial(self.pool_metrics.update, usage))
        self.outbox.call(functools.partial(self._prefilled, stage.params.request_id, usage, time.monotonic()))

    def _fail(self, sender, key: str, exc: Exception) -> None:
        self.outbox.call(functools.partial(sender.send, io.error_response(exc), flags=FINAL))
        self.outbox.call(functools.partial(self._ended, key))

    # On the outbox thread:

    def _answer(self, sender, stage, destination: str, first_output: bool, prefilled) -> None:
        first = prefilled.first
        try:
            if prefilled.kv is None:  # the engine moves its KV itself (engine=vllm): its transfer params go
                handle = engine_kv_handle(
                    len(stage.prompt_token_ids),
                    first.token_id,
                    first.logprobs,
                    prefilled.transfer_params or {},
                    prefilled.cached_tokens,
                    self.kv_ttl_s,
                ).to_json()
            else:
                handle = self.connectors.publish(
                    destination, prefilled.kv, first.token_id, first.logprobs, prefilled.cached_tokens
                ).to_json()
        except Exception as exc:  # noqa: BLE001 - KVBudgetExceeded becomes UNAVAILABLE
            sender.send(io.error_response(exc), flags=FINAL)
            return
        # Decode takes this KV only with prefill's seal over it and the prompt it belongs to.
        seal = self.seal.seal_prompt(stage.prompt_token_ids, stage.params_text, handle)
        outputs = [
            io.int32_tensor(tensors.FIRST_TOKEN_ID, [first.token_id]),
            io.string_tensor(tensors.KV_HANDLE, handle),
            io.string_tensor(tensors.STAGE_SEAL, seal),
        ]
        if first_output:
            try:
                shown = self.engine.first_output(
                    stage.prompt_token_ids, stage.params, prefilled.first, prefilled.cached_tokens
                )
            except Exception:  # noqa: BLE001 - the answer must go out: decode then sends the first output
                log.exception("request %s: making its first output failed", stage.params.request_id)
                shown = None
            outputs.append(io.string_tensor(tensors.FIRST_OUTPUT, "" if shown is None else shown.to_json()))
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)

    # vLLM's metrics (VllmMetrics): a prompt is a request running until its first token.

    def _arrived(self, key: str, now: float, prompt_tokens: int) -> None:
        self.vllm_metrics.arrived(key, now, prompt_tokens)
        self.vllm_metrics.requests(self.vllm_metrics.in_flight, 0)

    def _prefilled(self, key: str, usage, now: float) -> None:
        self.vllm_metrics.pool(usage)
        self.vllm_metrics.emitted(key, 1, now)  # the first token, sampled here
        self._ended(key, "length", now)  # one token asked, as vLLM's prefill in P/D

    def _ended(self, key: str, finish_reason: str | None = None, now: float | None = None) -> None:
        self.vllm_metrics.ended(key, finish_reason, now)
        self.vllm_metrics.requests(self.vllm_metrics.in_flight, 0)

    def _on_sweep(self, held: dict[str, int]) -> None:
        self.outbox.call(functools.partial(self.metrics.update, held))
