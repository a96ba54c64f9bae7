"""renderer: chat request -> prompt token ids (chat template + tokenizer, or Harmony), sealed.

Takes the client contract (chat_ensemble's first step, or a client calling it directly)
or, from `chat`, the ChatRequest chat parsed already (`chat_request`, sealed by chat),
so a request is parsed once per process. chat renders short requests itself and sends
this model the long ones and those with a chat_template of their own (ensemble.flow).
Its ids and generation params leave sealed: prefill and decode take no others. It also
answers the router's /tokenize and /detokenize (`tokenize_request`, `detokenize_request`:
vLLM's JSON in and out, `pdchat.core.request.tokenize`), a chat tokenized by the same
`render()` as a chat request.
"""

import json

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.request.grammar import load_xgrammar
from pdchat.core.request.protocol import ChatRequest, json_object
from pdchat.core.request.renderers import load_renderer
from pdchat.core.request.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize
from pdchat.core.settings import keep_off_decode_cpus, max_request_bytes
from pdchat.ensemble.seal import StageSeal
from pdchat.models import resolve_model
from pdchat.triton import io
from pdchat.triton.metrics import ParseMetrics, RenderMetrics
from pdchat.triton.server_watch import exit_with_server


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        keep_off_decode_cpus(parameters)  # decode's scheduler thread runs there alone
        settings = resolve_model(parameters)
        self.renderer = load_renderer(settings.path, settings.served_names, parameters)
        load_xgrammar()  # before the first request that carries a grammar
        self.max_request_bytes = max_request_bytes(parameters)
        self.seal = StageSeal.for_this_server()
        self.parses = ParseMetrics(args["model_name"])
        self.renders = RenderMetrics(args["model_name"])

    def execute(self, requests):
        return [self._render(request) for request in requests]

    def finalize(self):
        self.parses.close()
        self.renders.close()

    def _render(self, request):
        try:
            answer = self._tokenizer_answer(request)
            if answer is not None:
                return pb_utils.InferenceResponse(output_tensors=[io.string_tensor(tensors.RESPONSE, answer)])
            rendered = self.renderer.render(self._chat_request(request))
            params = rendered.params.to_json()
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its client
            return io.error_response(exc)
        self.renders.rendered()
        return pb_utils.InferenceResponse(
            output_tensors=[
                io.int32_tensor(tensors.PROMPT_TOKEN_IDS, rendered.prompt_token_ids),
                io.string_tensor(tensors.GENERATION_PARAMS, params),
                io.string_tensor(tensors.STAGE_SEAL, self.seal.seal_prompt(rendered.prompt_token_ids, params)),
            ]
        )

    def _tokenizer_answer(self, request) -> str | None:
        """The answer to a tokenize_request or detokenize_request (vLLM's JSON), else None."""
        tokenize_body = io.input_text(request, tensors.TOKENIZE_REQUEST, self.max_request_bytes)
        if tokenize_body is not None:
            answer = tokenize(self.renderer, parse_tokenize(json_object(tensors.TOKENIZE_REQUEST, tokenize_body)))
            return json.dumps(answer, ensure_ascii=False)
        detokenize_body = io.input_text(request, tensors.DETOKENIZE_REQUEST, self.max_request_bytes)
        if detokenize_body is not None:
            answer = detokenize(
                self.renderer, parse_detokenize(json_object(tensors.DETOKENIZE_REQUEST, detokenize_body))
            )
            return json.dumps(answer, ensure_ascii=False)
        return None

    def _chat_request(self, request) -> ChatRequest:
        canonical = io.input_text(request, tensors.CHAT_REQUEST)
        if canonical is None:
            chat, form = io.chat_request(request, self.max_request_bytes)
        else:
            self.seal.check_request(canonical, io.input_text(request, tensors.STAGE_SEAL))
            chat, form = ChatRequest.from_json(canonical), tensors.CHAT_REQUEST
        self.parses.parsed(form)
        return chat
