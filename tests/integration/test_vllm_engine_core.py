"""vLLM's engine core dying under a server with setting engine=vllm: apart from
test_vllm_engine.py, whose P/D pair is stopped by then (its idle engines poll two cores)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pdchat.clients.chat import ChatError, GrpcChat, chat_inputs
from pdchat.launcher import TritonServer, process_group
from tests.conversations import PARITY_CASES
from tests.integration.helpers import ask, wait_for
from tests.integration.vllm_servers import ENGINE_ENV, VLLM_TESTS

pytestmark = VLLM_TESTS


def test_a_dead_engine_core_fails_its_stream_and_takes_its_stub_down(tmp_path):
    """Its own server: vLLM's engine core killed under a stream, the stream fails (no vLLM
    traceback), and the decode stub exits, which is what supervision restarts a server for."""
    server = TritonServer(env={"PDCHAT_MODEL": "tiny", **ENGINE_ENV}, log_path=tmp_path / "server.log").start()
    try:
        client = GrpcChat(server.grpc_url, "chat")
        body = {"max_tokens": 4, "temperature": 0, **PARITY_CASES["single_turn"]}
        assert ask(client, body).finish_reason == "length"
        [core] = [pid for pid in process_group(server.process.pid) if "EngineCore" in _command(pid)]
        endless = {"max_tokens": 3000, "ignore_eos": True, "stream": True, **PARITY_CASES["single_turn"]}
        stream = client.stream(chat_inputs(endless))
        next(stream)
        os.kill(core, signal.SIGKILL)
        with pytest.raises(ChatError) as info:
            list(stream)
        assert "Traceback" not in str(info.value)
        assert wait_for(lambda: server.dead_stub() == "decode_0_0", timeout=15)
        client.close()
    finally:
        server.stop()


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") + Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""
