"""GrpcChat's cancelled streams leave nothing running: a front whose clients leave mid-stream,
or whose servers stall, keeps its thread count (and memory) flat. And what `waiting` says
of a stream's next response, which a front reads on its event loop only when it is an output.

Stand-in gRPC servers: one whose ModelStreamInfer reads requests and never answers, as a
stalled decode server does; one that sends the responses a test hands it, when it does."""

import queue
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from pdchat import tensors
from pdchat.clients.chat import ChatError, GrpcChat, ServerSilent, Waiting, chat_inputs
from pdchat.clients.router import RequestStreams
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


class Scripted(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers a streamed request with the responses put in `responses`, as they are put;
    the stream ends at a None, or once the client half-closes it."""

    def __init__(self):
        self.responses: queue.Queue = queue.Queue()

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        next(request_iterator)

        def until_closed() -> None:
            for _ in request_iterator:
                pass
            self.responses.put(None)

        threading.Thread(target=until_closed, daemon=True).start()
        while (response := self.responses.get()) is not None:
            yield service_pb2.ModelStreamInferResponse(infer_response=response)


def response(text: str | None, final: bool = False) -> service_pb2.ModelInferResponse:
    """A chat response carrying `text` as its `response` JSON, or none (a heartbeat)."""
    reply = service_pb2.ModelInferResponse(model_name="chat")
    reply.parameters["triton_final_response"].bool_param = final
    if text is not None:
        reply.outputs.add(name=tensors.RESPONSE, datatype="BYTES", shape=[1])
        reply.raw_output_contents.append(serialize_byte_tensor(np.array([text.encode()], dtype=np.object_)).item())
    return reply


def serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def silent_server():
    servicer = Silent()
    server, url = serve(servicer)
    yield url, servicer
    server.stop(grace=None)


@pytest.fixture
def scripted_server():
    servicer = Scripted()
    server, url = serve(servicer)
    yield url, servicer
    servicer.responses.put(None)
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


def test_waiting_says_which_next_responses_can_be_taken_without_waiting(scripted_server):
    url, servicer = scripted_server
    chat = GrpcChat(url, timeout_s=10)
    arrivals = threading.Semaphore(0)
    streams = RequestStreams()
    streams.on_arrival = arrivals.release
    assert chat.waiting() is Waiting.OTHER  # no stream runs

    def arrive(reply) -> None:
        servicer.responses.put(reply)
        assert arrivals.acquire(timeout=5)

    with streams.holding(chat, "r"):
        outputs = chat.stream(chat_inputs(HI))
        servicer.responses.put(response('{"n": 0}'))
        assert next(outputs).response == {"n": 0}  # the stream starts with its first `next`
        assert arrivals.acquire(timeout=5)
        assert chat.waiting() is Waiting.NOTHING and streams.waiting() is Waiting.NOTHING
        arrive(response(None))  # a heartbeat alone: still nothing to take
        assert chat.waiting() is Waiting.NOTHING
        arrive(response('{"n": 1}'))
        assert chat.waiting() is Waiting.OUTPUT and streams.waiting() is Waiting.OUTPUT
        assert next(outputs).response == {"n": 1}  # past the heartbeat
        arrive(response('{"n": 2}', final=True))
        assert chat.waiting() is Waiting.OTHER  # the last output: the `next` after it closes the stream
        assert next(outputs).response == {"n": 2}
        assert chat.waiting() is Waiting.OTHER
        assert list(outputs) == []
    assert chat.waiting() is Waiting.OTHER and streams.waiting() is Waiting.OTHER
    assert chat.on_arrival is None  # a pooled client is handed on without its last request's hook
    chat.close()


def test_waiting_is_other_for_a_bare_final_response(scripted_server):
    url, servicer = scripted_server
    chat = GrpcChat(url, timeout_s=10)
    outputs = chat.stream(chat_inputs(HI))
    servicer.responses.put(response('{"n": 0}'))
    next(outputs)
    servicer.responses.put(response(None, final=True))
    assert wait_for(lambda: chat.waiting() is not Waiting.NOTHING, timeout=5)
    assert chat.waiting() is Waiting.OTHER
    assert list(outputs) == []
    chat.close()
