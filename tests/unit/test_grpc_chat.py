"""GrpcChat's cancelled streams leave nothing running: a front whose clients leave mid-stream,
or whose servers stall, keeps its thread count (and memory) flat.

A stand-in gRPC server whose ModelStreamInfer reads requests and never answers, as a
stalled decode server does."""

import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from pdchat.clients.chat import ChatError, GrpcChat, ServerSilent, chat_inputs
from tests.integration.helpers import wait_for

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Silent(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Takes every streamed request, answers none; counts the streams still open."""

    def __init__(self):
        self.open = 0
        self._lock = threading.Lock()

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        with self._lock:
            self.open += 1
        try:
            for _ in request_iterator:  # ends once the client half-closes or cancels
                pass
            while context.is_active():
                time.sleep(0.02)
        finally:
            with self._lock:
                self.open -= 1
        return iter(())


@pytest.fixture
def silent_server():
    servicer = Silent()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def feeders() -> int:
    """gRPC's threads that feed a stream's requests to its call, one per open stream."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None and frame.f_code.co_name != "consume_request_iterator":
            frame = frame.f_back
        count += frame is not None
    return count


def test_a_stalled_stream_leaves_no_thread_behind(silent_server):
    url, servicer = silent_server
    chat = GrpcChat(url, timeout_s=0.2)
    before = feeders()
    for _ in range(3):
        with pytest.raises(ServerSilent):
            list(chat.stream(chat_inputs(HI)))
    assert wait_for(lambda: feeders() == before and servicer.open == 0, timeout=5)
    chat.close()


def test_a_stream_cancelled_from_another_thread_leaves_no_thread_behind(silent_server):
    url, servicer = silent_server
    chat = GrpcChat(url, timeout_s=30)
    before = feeders()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            list(chat.stream(chat_inputs(HI)))
        except ChatError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert wait_for(lambda: servicer.open == 1, timeout=5)
    chat.cancel()  # as a draining router ends its streams
    reader.join(5)
    assert not reader.is_alive() and len(errors) == 1
    assert wait_for(lambda: feeders() == before and servicer.open == 0, timeout=5)
    chat.close()
