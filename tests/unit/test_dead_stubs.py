"""TritonServer.dead_stub: a python stub gone while its server still serves its model counts
as the server's death; one gone with its model does not; a server that does not answer now
leaves the question open (the stub is looked at again), never forgotten."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from pdchat.launcher import TritonServer, free_port


@pytest.fixture
def model_ready_status():
    """(set(status), port): a stand-in server answering /v2/models/<m>/ready with a status."""
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status["code"])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield (lambda code: status.update(code=code)), server.server_address[1]
    server.shutdown()


def server_with_a_dead_stub(port: int) -> TritonServer:
    """A TritonServer whose own process runs (a sleeping stand-in) and whose one stub has exited."""
    server = TritonServer(http_port=port)
    server.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stub = subprocess.Popen([sys.executable, "-c", "pass"])
    stub.wait()
    server.stubs = {stub.pid: ("decode", "decode_0_0")}
    return server


def test_a_dead_stub_of_a_served_model_is_reported_each_look(model_ready_status):
    _, port = model_ready_status
    server = server_with_a_dead_stub(port)
    try:
        assert server.dead_stub() == "decode_0_0" and server.dead_stub() == "decode_0_0"
        assert server.exited()
    finally:
        server.process.kill()


def test_a_stub_gone_with_its_model_is_forgotten(model_ready_status):
    set_status, port = model_ready_status
    set_status(400)  # Triton: the model is not ready (unloaded)
    server = server_with_a_dead_stub(port)
    try:
        assert server.dead_stub() is None and server.stubs == {}
        assert not server.exited()
    finally:
        server.process.kill()


def test_a_server_that_does_not_answer_leaves_the_stub_to_look_at_again(model_ready_status):
    _, port = model_ready_status
    server = server_with_a_dead_stub(free_port())  # nothing listens there
    try:
        assert server.dead_stub() is None and server.stubs, "forgotten on a probe that got no answer"
        server.http_port = port
        assert server.dead_stub() == "decode_0_0"
    finally:
        server.process.kill()
