"""The signed handoff a prefill server gives a decode server, through the router.

`Handoff` is what a prefill server's `chat` signs for one request: the fingerprint of
the request's render inputs, an expiry and the handle of the published KV (with the first
token). Together with the prompt ids (beside it, as a binary tensor, or listed inside it
vLLM-style) it is the `kv_transfer_params` the router forwards untouched. The HMAC-SHA256
signature covers the ids too, so decode's gate knows both came from a prefill server of
this deployment, for this very conversation.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.kv.base import KVHandle, KVUnavailable
from pdchat.core.request.protocol import ChatRequest
from pdchat.core.settings import HANDOFF_KEY, HANDOFF_KEY_FILE

MIN_KEY_BYTES = 16
DEFAULT_TTL_S = 60.0
SIGNATURE_VERSION = 3


def load_key(environ: dict[str, str] | os._Environ | None = None) -> bytes | None:
    """The deployment's shared key: $PDCHAT_HANDOFF_KEY, else the file $PDCHAT_HANDOFF_KEY_FILE."""
    if text := HANDOFF_KEY.get(environ=environ):
        key = text.encode()
    elif key_file := HANDOFF_KEY_FILE.get(environ=environ):
        path = Path(key_file)
        try:
            key = path.read_bytes().strip()
        except OSError as exc:
            raise ModelUnavailable(f"cannot read the handoff key file {path}: {exc}") from exc
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ModelUnavailable(f"the handoff key must have at least {MIN_KEY_BYTES} bytes")
    return key


def render_fingerprint(request: ChatRequest, served_model: str, render_defaults: dict[str, Any] | None = None) -> str:
    """Canonical hash of everything the rendered prompt depends on: the request's render
    inputs and the server's (`render_defaults`: Harmony's date). Sampling and streaming
    fields are outside it: the router may change them between the legs."""
    inputs = {
        "model": served_model,
        "defaults": render_defaults or {},
        "reasoning_effort": request.reasoning_effort,
        "messages": request.messages,
        "prompt": request.prompt,  # a completions request's: text, or ids taken as the rendered prompt
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "chat_template_kwargs": request.chat_template_kwargs,
        "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message,
    }
    return hashlib.sha256(canonical_json(inputs)).hexdigest()


def ids_digest(ids: list[int] | np.ndarray) -> str:
    """SHA-256 of the ids as little-endian int32: the tensor's own bytes, no list on the way."""
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i4").data).hexdigest()


@dataclass(frozen=True)
class Handoff:
    """kv_transfer_params of one prefilled request, vLLM-shaped (`do_remote_prefill`) plus ours."""

    fingerprint: str
    expires_at: float
    kv_handle: KVHandle | None = None
    signature: str = ""
    # The prefill leg's answer `id` and `created`: the decode leg's answer goes on as the same
    # response (its first chunk may have come from the prefill leg). "" and 0: none given.
    response_id: str = ""
    created: int = 0

    def signed_bytes(self, prompt_token_ids: list[int]) -> bytes:
        handle = None if self.kv_handle is None else self.kv_handle.to_dict()
        return canonical_json(
            {
                "v": SIGNATURE_VERSION,
                "ids_sha256": ids_digest(prompt_token_ids),
                "fingerprint": self.fingerprint,
                "expires_at": self.expires_at,
                "kv_handle": handle,
                "response_id": self.response_id,
                "created": self.created,
            }
        )

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "fingerprint": self.fingerprint,
            "expires_at": self.expires_at,
            "kv_handle": None if self.kv_handle is None else self.kv_handle.to_dict(),
            "response_id": self.response_id,
            "created": self.created,
            "signature": self.signature,
        }

    def to_json(self) -> str:
        """The one serialization, made by the prefill server's `chat`, forwarded as is."""
        return orjson.dumps(self.to_params()).decode()

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Handoff:
        """Raises ValueError naming what is missing or mistyped."""
        try:
            signature = params["signature"]
            if not isinstance(signature, str):
                raise TypeError("signature must be a string")
            handle = params.get("kv_handle")
            response_id, created = params.get("response_id", ""), params.get("created", 0)
            if not isinstance(response_id, str) or type(created) is not int:
                raise TypeError("response_id must be a string and created an integer")
            return cls(
                str(params["fingerprint"]),
                float(params["expires_at"]),
                None if handle is None else KVHandle.from_dict(handle),
                signature,
                response_id,
                created,
            )
        except (KeyError, TypeError, ValueError, KVUnavailable) as exc:
            raise ValueError(
                "signed kv_transfer_params need fingerprint, expires_at, signature, a valid kv_handle "
                f"and, if any, a string response_id and an integer created ({exc})"
            ) from None


def sign(
    key: bytes,
    prompt_token_ids: list[int],
    fingerprint: str,
    *,
    kv_handle: KVHandle | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    response_id: str = "",
    created: int = 0,
) -> Handoff:
    handoff = Handoff(fingerprint, round((now or time.time()) + ttl_s, 3), kv_handle, "", response_id, created)
    return replace(handoff, signature=mac(key, handoff.signed_bytes(prompt_token_ids)))


def mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def same_mac(given: str, expected: str) -> bool:
    """Constant-time comparison as bytes: any string, ASCII or not, is just a wrong one."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same bytes for the same value on every server.
    What it cannot write exactly (an integer past 64 bits) is refused, never hashed as something else."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise InvalidRequest(f"the request holds a value this server cannot fingerprint: {exc}") from None
