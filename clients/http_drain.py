"""The HTTP front's drain: SIGTERM, SIGINT (clients/http_limits.py's server) or `POST /drain`.

From the moment a drain begins, new requests get 503 `draining` and `/health` 503; the
running ones have `drain_timeout_s` to finish, then end with an error, their servers told to
cancel them (`ChatFront.abort`). Then the process stops, whichever began it, so a supervisor
(systemd, Kubernetes) starts it again: a drained front never stays up refusing everything.
`POST /drain` needs authority: the API key where the front has one, else a client on this host
(`may_drain`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdchat.clients.fronts import ChatFront

log = logging.getLogger("pdchat.router.http")

DRAIN_POLL_S = 0.05  # how often a drain looks whether requests still run


class Drain:
    """Whether the front admits chat requests, and how many run (`counting`, by the guard).
    A drain ends those of `router` that run past `drain_timeout_s`, then waits
    `shutdown_timeout_s` at most for them."""

    def __init__(self, router: ChatFront, drain_timeout_s: float, shutdown_timeout_s: float):
        self._router = router
        self.drain_timeout_s, self.shutdown_timeout_s = drain_timeout_s, shutdown_timeout_s
        self.draining = False  # set once, never cleared
        self.running = 0  # chat requests being served
        self._drain: asyncio.Future[None] | None = None
        self.stop: Callable[[], None] = lambda: None  # stops the process once drained (the server sets it)

    @contextmanager
    def counting(self) -> Iterator[None]:
        """One chat request runs while inside."""
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1

    async def drain(self) -> None:
        """Stop admitting chat requests and answer `/health` with 503 from now on; let the
        running ones finish within `drain_timeout_s`, then end the rest. Returns once none
        runs, or `shutdown_timeout_s` after ending them. A later call waits for the same drain."""
        self.draining = True
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained())
        await asyncio.shield(self._drain)

    async def _drained(self) -> None:
        timeout = self.drain_timeout_s
        log.info("draining: no new requests; %d running have %g s to finish", self.running, timeout)
        if not await self._settled(timeout):
            log.warning("draining: ending the %d requests still running after %g s", self.running, timeout)
            reason = (
                f"this front is draining and the request did not finish within its drain timeout of {timeout:g} s "
                "(setting drain_timeout_s)"
            )
            self._router.abort(reason)  # cancels their gRPC streams: it does not block
            await self._settled(self.shutdown_timeout_s)
        log.info("drained: %d requests still running; stopping", self.running)
        self.stop()

    async def _settled(self, timeout: float) -> bool:
        """Whether no chat request runs, waiting up to `timeout` for that."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return not self.running


def may_drain(api_key: str | None, client_host: str | None) -> bool:
    """Whether a `POST /drain` may drain: with an API key the guard checked it already; without
    one, only a client on this host (a loopback address) may."""
    if api_key is not None:
        return True
    try:
        return client_host is not None and ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False
