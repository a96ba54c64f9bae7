"""Soak: hundreds of streams at concurrency 16 through `chat` / `chat_ensemble` (one server);
then streams abandoned mid-way. Nothing may fail, and nothing may stay behind: decode work,
shared-memory regions, memory. (The same soak through the router of a P/D pair runs on
test_pd's shm stack: a pair of its own here would cost a minute to start.)
"""

from __future__ import annotations

import pytest

from benchmarks import load
from tests.integration.soak import soak


@pytest.mark.parametrize("model", ["chat", "chat_ensemble"])
def test_monolithic_server_soaks(server, model):
    send = load.TritonStreams(server.grpc_url, model)
    try:
        # chat_ensemble cannot pass cancellation on (Triton 2.51): abandoned streams run to the end.
        soak(send, [server], server, abandon_cancels=model == "chat")
    finally:
        send.close()
