"""Who a request's caller is, where the front is told, and what follows from it.

The prefix cache is shared by every request of the same `cache_salt`, and a shared cache is
a side channel: a hit shows in `usage.prompt_tokens_details.cached_tokens` and in the time to
the first token, so a client can test guesses at another client's prompt (docs/security.md).
A front started with `--tenant-header NAME` (an authenticating proxy before it sets that
header) knows each request's tenant, and then
- salts every request per tenant (`salted`): `cache_salt` becomes a digest of the tenant and
  the salt the client sent, so tenants never share cached blocks (a client's own salt still
  splits its tenant's cache further), and a cache hit can only ever be the tenant's own;
- counts every request of a tenant against one share of decode's KV (`kv_owner`,
  setting decode_kv_share), so one tenant cannot reserve the whole pool.
Without it, each client request is its own owner (its n choices share one) and the cache is
shared as vLLM shares it.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from typing import Any

MAX_TENANT_BYTES = 256  # a longer header value is refused


class MissingTenant(ValueError):
    """The front names a tenant header the request does not carry."""


def tenant_of(values: Sequence[str], header: str | None) -> str | None:
    """The request's tenant: the one value of `header` it carries (`values`: every value of
    that header in the request), None where the front names no header. MissingTenant where
    there is none, more than one (a proxy that appends its header rather than replacing it
    would let a client name its own tenant), or an empty one or one over MAX_TENANT_BYTES."""
    if not header:
        return None
    if len(values) != 1 or not values[0].strip() or len(values[0].strip().encode()) > MAX_TENANT_BYTES:
        raise MissingTenant(
            f"this front serves each tenant apart: send header '{header}' once "
            f"(1 to {MAX_TENANT_BYTES} bytes; --tenant-header)"
        )
    return values[0].strip()


def salted(body: dict[str, Any], tenant: str | None) -> dict[str, Any]:
    """`body` with its `cache_salt` made the tenant's own (the body as it is without a tenant;
    an absent or null client salt is the tenant's plain one; a client salt that is neither
    nor a string stays for the parser to refuse by name)."""
    client_salt = body.get("cache_salt")
    if tenant is None or not isinstance(client_salt, str | None):
        return body
    return {**body, "cache_salt": f"tenant-{_digest(tenant, client_salt or '')}"}


def kv_owner(tenant: str | None) -> str:
    """Whose share of decode's KV a request counts against: its tenant's, else its own (a new
    owner per call: one client request, all of its n choices)."""
    return f"tenant-{_digest(tenant)}" if tenant is not None else f"request-{uuid.uuid4().hex}"


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()
