"""What every KV connector shares: the handle it hands out, its errors, its interface."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pdchat.core.errors import PdchatError, Unavailable
from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.registry import ENGINE_KV

DEFAULT_BUDGET_BYTES = 2 << 30
# KV dtypes on the wire: the model's own dtype, by name -> the numpy type carrying its bytes
# (numpy has no bfloat16: its 16 bits travel as uint16 and become bfloat16 again in torch).
KV_WIRE_TYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}
_WIRE_NAMES = {carrier: name for name, carrier in KV_WIRE_TYPES.items()}
# KV layout on the wire: [layers, 2 (key, value), kv_heads, tokens, head_dim].
KV_TOKEN_AXIS = 3


def tokens_from(kv: np.ndarray, start: int) -> np.ndarray:
    """The KV of tokens [start:] (a view)."""
    return kv[(slice(None),) * KV_TOKEN_AXIS + (slice(start, None),)]


def kv_dtype_name(kv: np.ndarray) -> str:
    """The dtype an exported KV array carries (engine.export_kv's arrays only)."""
    try:
        return _WIRE_NAMES[kv.dtype]
    except KeyError:
        raise ValueError(f"KV arrays travel as {', '.join(KV_WIRE_TYPES)}; got numpy {kv.dtype}") from None


DEFAULT_KV_TTL_S = 60.0

log = logging.getLogger("pdchat.kv")


class KVUnavailable(PdchatError):
    """The KV named by a handle cannot be had (expired, pulled already, peer gone, handle
    malformed). Decode then recomputes the prompt's KV from its ids; one that escapes that
    fallback is a fault of the server (INTERNAL)."""


class KVBudgetExceeded(Unavailable):
    """Holding this KV would pass the server's KV budget."""


@dataclass(frozen=True)
class KVHandle:
    """Where prefill published one prompt's KV, and the token it sampled after it.

    Travels prefill -> chat -> (signed, router) -> decode's chat -> decode as `to_json()`.
    `location` is the connector's own address of the KV (shm: a file name; nixl: agent,
    metadata, buffer id and address); nothing outside the connector reads it.
    `first_token_logprobs`: that token's logprobs when the request asked for them, so the
    handoff's signature and chat's seal cover them like the token itself.
    """

    connector: str
    shape: tuple[int, ...]
    expires_at: float
    first_token_id: int
    location: dict[str, Any] = field(default_factory=dict)
    first_token_logprobs: TokenLogprobs | None = None
    dtype: str = "float32"  # the prefill model's dtype (KV_WIRE_TYPES)
    cached_tokens: int = 0  # prompt tokens prefill took from its prefix cache (the client's usage shows them)

    @property
    def wire_type(self) -> np.dtype:
        return KV_WIRE_TYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.wire_type.itemsize

    def to_dict(self) -> dict[str, Any]:
        """The handle as JSON values; `first_token_logprobs` only when there are some."""
        value = {
            "connector": self.connector,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "expires_at": self.expires_at,
            "first_token_id": self.first_token_id,
            "location": self.location,
        }
        if self.first_token_logprobs is not None:
            value["first_token_logprobs"] = self.first_token_logprobs.to_dict()
        if self.cached_tokens:
            value["cached_tokens"] = self.cached_tokens
        return value

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, value: Any) -> KVHandle:
        """Raises KVUnavailable naming what is wrong (a handle is data from another process)."""
        try:
            if not isinstance(value["location"], dict):
                raise TypeError("location must be an object")
            shape = tuple(int(n) for n in value["shape"])
            if not shape or min(shape) < 0:
                raise ValueError(f"bad shape {value['shape']!r}")
            first_token_id = int(value["first_token_id"])
            logprobs = value.get("first_token_logprobs")
            logprobs = None if logprobs is None else TokenLogprobs.from_dict(logprobs)
            if logprobs is not None and logprobs.token_id != first_token_id:
                raise ValueError("first_token_logprobs are not those of first_token_id")
            dtype = str(value.get("dtype", "float32"))
            if dtype not in KV_WIRE_TYPES:
                raise ValueError(f"dtype {dtype!r} is none of {', '.join(KV_WIRE_TYPES)}")
            return cls(
                str(value["connector"]),
                shape,
                float(value["expires_at"]),
                first_token_id,
                value["location"],
                logprobs,
                dtype,
                max(0, int(value.get("cached_tokens", 0))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KVUnavailable(f"malformed KV handle: {exc!r}") from None

    @classmethod
    def from_json(cls, text: str) -> KVHandle:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError as exc:
            raise KVUnavailable(f"malformed KV handle: {exc}") from None


def engine_kv_handle(
    prompt_tokens: int,
    first_token_id: int,
    first_token_logprobs: TokenLogprobs | None,
    transfer_params: dict[str, Any],
    cached_tokens: int,
    ttl_s: float,
) -> KVHandle:
    """The handle of a prompt's KV that its engine moves itself (registry.ENGINE_KV): the
    engine's transfer parameters (vLLM's kv_transfer_params) as its location. Signed into the
    handoff like any handle, so a decode engine reads only KV a prefill server handed out."""
    expires_at = round(time.time() + ttl_s, 3)
    return KVHandle(
        ENGINE_KV,
        (prompt_tokens,),
        expires_at,
        first_token_id,
        dict(transfer_params),
        first_token_logprobs,
        cached_tokens=cached_tokens,
    )


def engine_transfer_params(handle: KVHandle) -> dict[str, Any] | None:
    """What a decode engine pulls an ENGINE_KV handle's KV with; None where there is nothing
    to pull (the handle expired, or its prefill engine moves no KV): decode then computes the
    prompt from its ids."""
    if not handle.location or time.time() > handle.expires_at:
        return None
    return dict(handle.location)


class KVConnector(Protocol):
    name: str
    # True where a pull waits on another process or host (a network transfer): decode then
    # pulls before the request joins its batch, off the thread that steps it.
    pull_waits: bool

    def publish(self, kv: np.ndarray, first_token_id: int) -> KVHandle:
        """Hold `kv` for a decode server; return its handle."""

    def pull(self, handle: KVHandle, start_token: int = 0) -> np.ndarray:
        """Fetch the KV a handle names, of its tokens from `start_token` on (decode already
        holds the ones before)."""

    def done(self, handle: KVHandle) -> None:
        """The pulled KV is no longer read: the prefill side may free or reuse it."""

    def discard(self, handle: KVHandle) -> None:
        """The request of `handle` ended before its KV was pulled: the prefill side may free
        it now rather than at its TTL. Nothing if it was pulled or is gone."""

    def sweep(self) -> int:
        """Free expired KV; return how many were freed."""

    def held_bytes(self) -> int:
        """Bytes this connector currently holds for pulls."""

    def close(self) -> None:
        """Free everything this connector holds."""


class OncePerKey:
    """Logs a warning the first time a key is seen: a foreign entry in /dev/shm is worth
    one line, not one per sweep."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._seen:
            self._seen.add(key)
            log.warning(message, *args)
