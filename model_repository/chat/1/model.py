"""chat (BLS, decoupled): the client-facing model, in front of the stage models.

Translates the client contract (`pdchat.tensors`, auto-completed) into `ChatInputs` and hands
it to the route-and-stages flow (`pdchat.ensemble.flow.ChatFlow`), whose stages are BLS calls
(`pdchat.triton.chat_stages.BLSStages`). Whatever refuses a request goes back as its error.

NOTE: each request is a coroutine on the model's one event loop (`pdchat.triton.event_loop`),
the only thread that calls into the server process; blocking BLS calls run on its lanes
(`stage_lanes`). See docs/notes/python-backend-concurrency.md.
"""

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.settings import keep_off_decode_cpus, max_request_bytes, stage_lanes
from pdchat.ensemble.flow import ChatFlow, ChatInputs
from pdchat.models import resolve_model
from pdchat.triton import io
from pdchat.triton.chat_stages import BLSStages, StageError
from pdchat.triton.event_loop import ModelEventLoop
from pdchat.triton.metrics import HandoffMetrics, ParseMetrics
from pdchat.triton.server_watch import exit_with_server

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Requests served at once; more wait (as coroutines, holding nothing) for a slot.
MAX_CONCURRENT_REQUESTS = 64


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(0)
        config.set_model_transaction_policy({"decoupled": True})
        return io.declare_contract(config, tensors.CHAT_INPUTS, tensors.CHAT_OUTPUTS)

    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        keep_off_decode_cpus(parameters)  # decode's scheduler thread runs there alone
        model = resolve_model(parameters)
        self.metrics = HandoffMetrics(args["model_name"])
        self.parses = ParseMetrics(args["model_name"])
        self.flow = ChatFlow.for_model(model.path, model.served_names, parameters, self.metrics)
        self.max_request_bytes = max_request_bytes(parameters)
        self.stage_lanes = stage_lanes(parameters)
        self.loop = ModelEventLoop("pdchat-chat", MAX_CONCURRENT_REQUESTS)

    def execute(self, requests):
        for request in requests:
            self.loop.submit(self._serve(request, request.get_response_sender()))
        return None

    def finalize(self):
        self.loop.close()
        self.metrics.close()
        self.parses.close()

    async def _serve(self, request, sender):
        try:
            chat, form = io.chat_request(request, self.max_request_bytes)
            self.parses.parsed(form)
            inputs = ChatInputs(
                chat,
                io.input_token_ids(request, tensors.PROMPT_TOKEN_IDS),
                io.input_text(request, tensors.KV_TRANSFER_PARAMS),
            )
            await self.flow.serve(inputs, BLSStages(request, sender, self.loop, self.stage_lanes))
        except StageError as exc:
            sender.send(pb_utils.InferenceResponse(error=exc.error), flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its client
            sender.send(io.error_response(exc), flags=FINAL)
