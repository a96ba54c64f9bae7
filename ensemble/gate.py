"""The gate for forwarded prompt token ids (the signed handoff that opens it: ensemble.handoff).

vLLM lets any client send `kv_transfer_params["prompt_token_ids"]`, which bypasses the
chat template. Here a server accepts forwarded ids only under a configured policy:

- `off`: refused (the default of a monolithic server);
- `signed`: accepted only with a prefill server's HMAC-SHA256 signature over the ids,
  the KV handle, an expiry and the fingerprint of the request's render inputs, once;
- `trusted`: unsigned ids accepted too (vLLM-compatible), only when configured.

"Once" means one request that decode took: an admitted handoff is reserved (`Admission`),
spent once decode took its request, released when the request is refused or fails before.
"""

from __future__ import annotations

import enum
import functools
import heapq
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.kv.base import KVHandle
from pdchat.core.settings import HANDOFF_KEY, HANDOFF_KEY_FILE
from pdchat.ensemble.handoff import Handoff, mac, same_mac


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
    REPLAYED = "replayed"


class ForwardedIdsRejected(InvalidRequest):
    def __init__(self, reason: Rejection, detail: str):
        super().__init__(f"forwarded prompt token ids refused ({reason.value}): {detail}")
        self.reason = reason


def parse_policy(value: str) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise ModelUnavailable(f"forwarded_ids policy must be one of off, signed, trusted; got {value!r}") from None


class Admission:
    """Forwarded ids the gate admitted: their signed KV handle (None if there is none), and
    the hold on a signed handoff's one use.

    While held, the handoff is refused as replayed (a second request using it at the same
    time). `spend()` once decode took the request: refused as replayed until it expires.
    `release()` if the request was refused or failed before that: the handoff may be used
    again. The first of the two settles it, later calls do nothing; as a context manager it
    is released on exit unless spent."""

    def __init__(
        self,
        kv_handle: KVHandle | None,
        settle: Callable[[bool], None] | None = None,
        handoff: Handoff | None = None,
    ):
        self.kv_handle = kv_handle
        self.handoff = handoff  # the signed handoff admitted (None: unsigned ids)
        self._settle = settle  # settle(spent); None: unsigned, or settled

    def spend(self) -> None:
        self._settled(spent=True)

    def release(self) -> None:
        self._settled(spent=False)

    def _settled(self, *, spent: bool) -> None:
        settle, self._settle = self._settle, None
        if settle is not None:
            settle(spent)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class _Use(enum.Enum):
    RESERVED = "reserved"
    SPENT = "spent"
    RELEASED = "released"


@dataclass(frozen=True)
class Gate:
    """Decode's check of forwarded ids, configured once per server. A signed handoff serves
    one request: its signature is remembered until it expires (reserved while its request is
    in flight, then spent or released), so a replay (which would make this server recompute
    a prefill for free) is refused."""

    policy: Policy
    key: bytes | None
    vocab_size: int
    context_length: int
    _uses: dict[str, _Use] = field(default_factory=dict, compare=False, repr=False)
    _by_expiry: list[tuple[float, str]] = field(default_factory=list, compare=False, repr=False)  # heap
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy is Policy.SIGNED and self.key is None:
            raise ModelUnavailable(
                f"forwarded_ids policy 'signed' needs a handoff key: set {HANDOFF_KEY.env} or {HANDOFF_KEY_FILE.env}"
            )

    def admit(
        self, ids: list[int] | np.ndarray, params: dict[str, Any], fingerprint: str, *, now: float | None = None
    ) -> Admission:
        """Check forwarded ids; a signed handoff is reserved until the admission is spent or
        released. Raises ForwardedIdsRejected."""
        if self.policy is Policy.OFF:
            raise ForwardedIdsRejected(
                Rejection.POLICY_OFF, "this server does not accept them (policy 'off'); send the conversation only"
            )
        self._check_ids(ids)
        if params.get("signature") is None:
            if self.policy is Policy.TRUSTED:
                return Admission(None)
            raise ForwardedIdsRejected(
                Rejection.UNSIGNED, "policy 'signed' needs kv_transfer_params signed by a prefill server"
            )
        if self.key is None:
            raise ForwardedIdsRejected(
                Rejection.BAD_SIGNATURE, "this server has no handoff key to verify the signature"
            )
        try:
            handoff = Handoff.from_params(params)
        except ValueError as exc:
            raise ForwardedIdsRejected(Rejection.MALFORMED, str(exc)) from None
        if not same_mac(handoff.signature, mac(self.key, handoff.signed_bytes(ids))):
            raise ForwardedIdsRejected(Rejection.BAD_SIGNATURE, "the signature does not match these ids and parameters")
        now = now or time.time()
        if now > handoff.expires_at:
            raise ForwardedIdsRejected(Rejection.EXPIRED, "the handoff expired; send the request to prefill again")
        if not hmac.compare_digest(handoff.fingerprint, fingerprint):
            raise ForwardedIdsRejected(
                Rejection.FINGERPRINT_MISMATCH, "the ids were signed for a different conversation"
            )
        return self._reserve(handoff, now)

    def _reserve(self, handoff: Handoff, now: float) -> Admission:
        with self._lock:
            # Forget what has expired (it is refused as expired anyway): O(log n) per request.
            while self._by_expiry and self._by_expiry[0][0] < now:
                self._uses.pop(heapq.heappop(self._by_expiry)[1], None)
            use = self._uses.get(handoff.signature)
            if use is _Use.RESERVED:
                raise ForwardedIdsRejected(
                    Rejection.REPLAYED,
                    "this handoff is in use by a request in flight; send the request to prefill again",
                )
            if use is _Use.SPENT:
                raise ForwardedIdsRejected(
                    Rejection.REPLAYED, "this handoff was used already; send the request to prefill again"
                )
            if use is None:
                heapq.heappush(self._by_expiry, (handoff.expires_at, handoff.signature))
            self._uses[handoff.signature] = _Use.RESERVED
        return Admission(handoff.kv_handle, functools.partial(self._settle, handoff.signature), handoff)

    def _settle(self, signature: str, spent: bool) -> None:
        with self._lock:
            if self._uses.get(signature) is _Use.RESERVED:  # not forgotten meanwhile, past its expiry
                self._uses[signature] = _Use.SPENT if spent else _Use.RELEASED

    def _check_ids(self, ids: list[int] | np.ndarray) -> None:
        if len(ids) == 0:
            raise ForwardedIdsRejected(Rejection.EMPTY, "the id list is empty")
        if len(ids) >= self.context_length:
            raise ForwardedIdsRejected(
                Rejection.TOO_LONG, f"{len(ids)} ids; this model's context is {self.context_length}"
            )
        array = np.asarray(ids)
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self.vocab_size:
            raise ForwardedIdsRejected(
                Rejection.OUT_OF_VOCABULARY, f"ids must lie in [0, {self.vocab_size}); got {low}..{high}"
            )


def forwarded_ids(
    binary: list[int] | None,
    kv_transfer_params: str | dict[str, Any] | None,
    binary_source: str = "the prompt_token_ids tensor",
) -> tuple[list[int] | None, dict[str, Any]]:
    """Ids from `binary` (`binary_source` says where they came from) or
    kv_transfer_params["prompt_token_ids"] (vLLM wire form), and the params with that key
    consumed. The params come as the tensor's JSON text or, from the request body, already parsed."""
    params: dict[str, Any] = {}
    if isinstance(kv_transfer_params, str):
        try:
            kv_transfer_params = orjson.loads(kv_transfer_params)
        except orjson.JSONDecodeError as exc:
            raise ForwardedIdsRejected(Rejection.MALFORMED, f"kv_transfer_params is not valid JSON: {exc}") from exc
    if kv_transfer_params is not None:
        if not isinstance(kv_transfer_params, dict):
            raise ForwardedIdsRejected(Rejection.MALFORMED, "kv_transfer_params must be a JSON object")
        params = dict(kv_transfer_params)
    listed = params.pop("prompt_token_ids", None)
    if listed is not None and binary is not None:
        raise ForwardedIdsRejected(
            Rejection.MALFORMED, f"give the ids once: as {binary_source} or inside kv_transfer_params"
        )
    if listed is not None:
        return id_array(listed, "kv_transfer_params.prompt_token_ids"), params
    return binary, params


def id_array(listed: Any, name: str) -> np.ndarray:
    """vLLM's JSON list of ids (`name` says where it came from) as one int64 array, checked
    in bulk, not id by id."""
    array = np.array(listed) if isinstance(listed, list) else None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind != "i"):
        raise ForwardedIdsRejected(Rejection.MALFORMED, f"{name} must be a list of integers")
    return array.astype(np.int64, copy=False)
