"""The `chat` model's route decision (RoutePlanner), made once per request before any rendering.

- forwarded prompt ids present and admitted by the gate -> REUSE: decode directly,
  the renderer does not run;
- `kv_transfer_params.do_remote_decode` -> REMOTE_PREFILL: render and prefill here, answer
  with the first token and signed kv_transfer_params for a decode server;
- signed kv_transfer_params without the ids -> RENDER_VERIFIED: the comparison mode of
  the benchmarks (what vLLM did before forwarding ids): render and tokenize here, then use
  the transferred KV once the rendered ids pass the gate (they hash to the signed digest);
- otherwise -> RENDER: renderer -> prefill -> decode.

Because it happens before any renderer, the decision covers every render format alike.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdchat.core.errors import InvalidRequest
from pdchat.core.kv.base import KVHandle
from pdchat.core.request.protocol import ChatRequest, GenerationParams, served_names
from pdchat.core.settings import HANDOFF_KEY
from pdchat.ensemble.gate import Admission, ForwardedIdsRejected, Gate, Rejection, forwarded_ids, id_array
from pdchat.ensemble.handoff import DEFAULT_TTL_S, Handoff, render_fingerprint, sign


class Route(str, enum.Enum):
    RENDER = "render"
    REUSE = "reuse"
    REMOTE_PREFILL = "remote_prefill"
    RENDER_VERIFIED = "render_verified"


@dataclass(frozen=True)
class RoutePlan:
    route: Route
    chat: ChatRequest
    # REUSE only: the admitted ids, the generation params the renderer would have made, and the
    # gate's admission (the signed KV handle; the handoff held, to be spent or released).
    prompt_token_ids: list[int] | None = None
    generation: GenerationParams | None = None
    admission: Admission | None = None
    # RENDER_VERIFIED only: the signed params the rendered ids must match.
    signed_params: dict | None = None


class RoutePlanner:
    def __init__(
        self,
        gate: Gate,
        served_name: str | Sequence[str],
        ttl_s: float = DEFAULT_TTL_S,
        render_defaults: Callable[[], dict[str, Any]] = dict,
    ):
        self.gate = gate
        self.served_names = served_names(served_name)  # a request may name any
        self.served_name = self.served_names[0]  # what answers report, and the fingerprint names
        self.ttl_s = ttl_s
        self.render_defaults = render_defaults  # the renderer's server-side inputs, as of now

    def fingerprint(self, chat: ChatRequest) -> str:
        return render_fingerprint(chat, self.served_name, self.render_defaults())

    def plan(self, chat: ChatRequest, binary_ids: list[int] | None, kv_transfer_params: str | None) -> RoutePlan:
        """Decide the path; refusals raise InvalidRequest (ForwardedIdsRejected for the gate's).
        `kv_transfer_params`: the tensor's text; the request body may carry them instead.
        NOTE: a REUSE plan holds its handoff (`admission`): the caller spends or releases it."""
        if kv_transfer_params is not None and chat.kv_transfer_params is not None:
            raise ForwardedIdsRejected(
                Rejection.MALFORMED, "give kv_transfer_params once: as the tensor or in the request JSON"
            )
        if chat.prompt_token_ids is not None:  # the top-level JSON form: as the tensor
            if binary_ids is not None:
                raise ForwardedIdsRejected(
                    Rejection.MALFORMED, "give the ids once: as the prompt_token_ids tensor or in the request JSON"
                )
            binary_ids = id_array(chat.prompt_token_ids, "prompt_token_ids")
        ids, params = forwarded_ids(
            binary_ids,
            kv_transfer_params if kv_transfer_params is not None else chat.kv_transfer_params,
            "the prompt_token_ids tensor" if chat.prompt_token_ids is None else "the top-level prompt_token_ids",
        )
        if ids is not None:
            admission = self.gate.admit(ids, params, self.fingerprint(chat))
            try:
                generation = chat.generation_params(
                    len(ids), self.gate.context_length, self.gate.vocab_size, self.served_names
                )
                handoff = admission.handoff
                if handoff is not None and handoff.response_id:  # the prefill leg's answer goes on here
                    generation = replace(generation, request_id=handoff.response_id, created=handoff.created)
            except BaseException:
                admission.release()  # refused here: the handoff stays good for a corrected request
                raise
            return RoutePlan(Route.REUSE, chat, ids, generation, admission)
        if "signature" in params:
            if self.gate.key is None:
                raise ForwardedIdsRejected(
                    Rejection.BAD_SIGNATURE, "this server has no handoff key to verify the signature"
                )
            return RoutePlan(Route.RENDER_VERIFIED, chat, signed_params=params)
        if type(params.get("do_remote_decode", False)) not in (bool, type(None)):
            raise InvalidRequest(
                f"kv_transfer_params.do_remote_decode must be true or false, got {params['do_remote_decode']!r}"
            )
        if params.get("do_remote_decode") is True:
            if self.gate.key is None:
                raise InvalidRequest(f"do_remote_decode needs this server to have a handoff key ({HANDOFF_KEY.env})")
            return RoutePlan(Route.REMOTE_PREFILL, chat)
        return RoutePlan(Route.RENDER, chat)

    def admit_rendered(self, plan: RoutePlan, rendered_ids: list[int]) -> Admission:
        """RENDER_VERIFIED: the transferred KV, if the ids rendered here are the ones prefill
        signed (same checks as forwarded ids: signature, expiry, fingerprint, once; the
        caller spends or releases the admission)."""
        return self.gate.admit(rendered_ids, plan.signed_params or {}, self.fingerprint(plan.chat))

    def sign_handoff(
        self,
        chat: ChatRequest,
        prompt_token_ids: list[int],
        kv_handle: KVHandle | None = None,
        now: float | None = None,
        answer: GenerationParams | None = None,
    ) -> Handoff:
        """The signed handoff for the decode leg. The ids travel beside it as the binary
        prompt_token_ids tensor (a router may also list them inside, vLLM-style). `answer`:
        the prefill leg's generation params, whose response id and time the decode leg's
        answer takes on."""
        assert self.gate.key is not None  # plan() refused REMOTE_PREFILL without a key
        return sign(
            self.gate.key,
            prompt_token_ids,
            self.fingerprint(chat),
            kv_handle=kv_handle,
            ttl_s=self.ttl_s,
            now=now or time.time(),
            response_id="" if answer is None else answer.request_id,
            created=0 if answer is None else answer.created,
        )
