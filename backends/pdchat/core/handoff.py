"""The gate for forwarded prompt token ids, and the signed handoff that opens it.

vLLM lets any client send `kv_transfer_params["prompt_token_ids"]`, which bypasses the
chat template. Here a server accepts forwarded ids only under a configured policy:

- `off`: refused (the default of a monolithic server);
- `signed`: accepted only with a prefill server's HMAC-SHA256 signature over the ids,
  the KV handle, an expiry and the fingerprint of the request's render inputs;
- `trusted`: unsigned ids accepted too (vLLM-compatible), only when configured.

Sampling and streaming fields are outside the fingerprint: the router may change them.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.protocol import ChatRequest

ENV_KEY = "PDCHAT_HANDOFF_KEY"
ENV_KEY_FILE = "PDCHAT_HANDOFF_KEY_FILE"
MIN_KEY_BYTES = 16
DEFAULT_TTL_S = 60.0
SIGNATURE_VERSION = 1


class Policy(str, enum.Enum):
    OFF = "off"
    SIGNED = "signed"
    TRUSTED = "trusted"


class Rejection(str, enum.Enum):
    """Why forwarded ids were refused; also the `reason` label of the metrics."""

    POLICY_OFF = "policy_off"
    MALFORMED = "malformed"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    EMPTY = "empty"
    OUT_OF_VOCABULARY = "out_of_vocabulary"
    TOO_LONG = "too_long"


class ForwardedIdsRejected(InvalidRequest):
    def __init__(self, reason: Rejection, detail: str):
        super().__init__(f"forwarded prompt token ids refused ({reason.value}): {detail}")
        self.reason = reason


def load_key(environ: dict[str, str] | os._Environ | None = None) -> bytes | None:
    """The deployment's shared key: $PDCHAT_HANDOFF_KEY, else the file $PDCHAT_HANDOFF_KEY_FILE."""
    env = os.environ if environ is None else environ
    if env.get(ENV_KEY):
        key = env[ENV_KEY].encode()
    elif env.get(ENV_KEY_FILE):
        path = Path(env[ENV_KEY_FILE])
        try:
            key = path.read_bytes().strip()
        except OSError as exc:
            raise ModelUnavailable(f"cannot read the handoff key file {path}: {exc}") from exc
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ModelUnavailable(f"the handoff key must have at least {MIN_KEY_BYTES} bytes")
    return key


def parse_policy(value: str) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise ModelUnavailable(f"forwarded_ids policy must be one of off, signed, trusted; got {value!r}") from None


def render_fingerprint(request: ChatRequest, served_model: str) -> str:
    """Canonical hash of everything the rendered prompt depends on."""
    inputs = {
        "model": served_model,
        "messages": request.messages,
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "chat_template_kwargs": request.chat_template_kwargs,
        "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message,
    }
    return hashlib.sha256(_canonical(inputs)).hexdigest()


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


@dataclass(frozen=True)
class Handoff:
    """What prefill signs and decode verifies."""

    ids_sha256: str
    fingerprint: str
    expires_at: float
    kv_handle: dict[str, Any] | None = None

    def payload(self) -> bytes:
        return _canonical({"v": SIGNATURE_VERSION, "ids_sha256": self.ids_sha256, "fingerprint": self.fingerprint,
                           "expires_at": self.expires_at, "kv_handle": self.kv_handle})


def sign(key: bytes, prompt_token_ids: list[int], fingerprint: str, *, kv_handle: dict | None = None,
         ttl_s: float = DEFAULT_TTL_S, now: float | None = None) -> dict[str, Any]:
    """kv_transfer_params for the router to forward to decode (vLLM-shaped, plus ours)."""
    handoff = Handoff(ids_digest(prompt_token_ids), fingerprint, round((now or time.time()) + ttl_s, 3), kv_handle)
    return {
        "do_remote_prefill": True,
        "kv_handle": kv_handle,
        "expires_at": handoff.expires_at,
        "fingerprint": fingerprint,
        "signature": hmac.new(key, handoff.payload(), hashlib.sha256).hexdigest(),
    }


@dataclass(frozen=True)
class Gate:
    """Decode's check of forwarded ids, configured once per server."""

    policy: Policy
    key: bytes | None
    vocab_size: int
    context_length: int

    def __post_init__(self) -> None:
        if self.policy is Policy.SIGNED and self.key is None:
            raise ModelUnavailable(
                f"forwarded_ids policy 'signed' needs a handoff key: set {ENV_KEY} or {ENV_KEY_FILE}"
            )

    def admit(self, ids: list[int], params: dict[str, Any], fingerprint: str, *, now: float | None = None) -> dict | None:
        """Check forwarded ids; return the signed KV handle (or None). Raises ForwardedIdsRejected."""
        if self.policy is Policy.OFF:
            raise ForwardedIdsRejected(Rejection.POLICY_OFF, "this server does not accept them (policy 'off'); send the conversation only")
        self._check_ids(ids)
        signature = params.get("signature")
        if signature is None:
            if self.policy is Policy.TRUSTED:
                return None
            raise ForwardedIdsRejected(Rejection.UNSIGNED, "policy 'signed' needs kv_transfer_params signed by a prefill server")
        if self.key is None:
            raise ForwardedIdsRejected(Rejection.BAD_SIGNATURE, "this server has no handoff key to verify the signature")
        try:
            handoff = Handoff(ids_digest(ids), str(params["fingerprint"]), float(params["expires_at"]), params.get("kv_handle"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ForwardedIdsRejected(Rejection.MALFORMED, f"signed kv_transfer_params need fingerprint and expires_at ({exc})") from exc
        expected = hmac.new(self.key, handoff.payload(), hashlib.sha256).hexdigest()
        if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
            raise ForwardedIdsRejected(Rejection.BAD_SIGNATURE, "the signature does not match these ids and parameters")
        if (now or time.time()) > handoff.expires_at:
            raise ForwardedIdsRejected(Rejection.EXPIRED, "the handoff expired; send the request to prefill again")
        if not hmac.compare_digest(handoff.fingerprint, fingerprint):
            raise ForwardedIdsRejected(Rejection.FINGERPRINT_MISMATCH, "the ids were signed for a different conversation")
        return handoff.kv_handle

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ForwardedIdsRejected(Rejection.EMPTY, "the id list is empty")
        if len(ids) >= self.context_length:
            raise ForwardedIdsRejected(Rejection.TOO_LONG, f"{len(ids)} ids; this model's context is {self.context_length}")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            raise ForwardedIdsRejected(Rejection.OUT_OF_VOCABULARY, f"ids must lie in [0, {self.vocab_size}); got {low}..{high}")


def forwarded_ids(binary: list[int] | None, kv_transfer_params: str | None) -> tuple[list[int] | None, dict[str, Any]]:
    """Ids from the binary tensor or kv_transfer_params["prompt_token_ids"] (vLLM wire form),
    and the params with that key consumed."""
    params: dict[str, Any] = {}
    if kv_transfer_params is not None:
        try:
            params = json.loads(kv_transfer_params)
        except ValueError as exc:
            raise ForwardedIdsRejected(Rejection.MALFORMED, f"kv_transfer_params is not valid JSON: {exc}") from exc
        if not isinstance(params, dict):
            raise ForwardedIdsRejected(Rejection.MALFORMED, "kv_transfer_params must be a JSON object")
    listed = params.pop("prompt_token_ids", None)
    if listed is not None and binary is not None:
        raise ForwardedIdsRejected(Rejection.MALFORMED, "give the ids once: as the prompt_token_ids tensor or inside kv_transfer_params")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
            raise ForwardedIdsRejected(Rejection.MALFORMED, "kv_transfer_params.prompt_token_ids must be a list of integers")
        return listed, params
    return binary, params


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
