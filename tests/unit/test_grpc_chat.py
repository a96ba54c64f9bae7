"""GrpcChat's cancelled streams leave nothing running: a front whose clients leave mid-stream,
or whose servers stall, keeps its thread count (and memory) flat and its server's streams
closed.

Stand-in gRPC servers: one whose ModelStreamInfer reads requests and never answers, as a
stalled decode server does; one that sends the responses a test hands it, when it does."""

import asyncio
import queue
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pdchat import tensors
from pdchat.clients.chat import DEFAULT_MODEL, ChatError, GrpcChat, ServerSilent, chat_inputs
from pdchat.clients.grpc_streams import raw_tensor
from pdchat.core.errors import ErrorCode
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
    the stream ends at a None, or once the client half-closes or cancels it."""

    def __init__(self):
        self.responses: queue.Queue = queue.Queue()
        self.requests: list[service_pb2.ModelInferRequest] = []  # as they came

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        yield from self._answer(next(request_iterator), request_iterator)

    def _answer(self, first, request_iterator):
        self.requests.append(first)

        def until_closed() -> None:
            try:
                for request in request_iterator:
                    self.requests.append(request)
            except grpc.RpcError:  # the client cancelled the stream rather than half-closed it
                pass
            self.responses.put(None)

        threading.Thread(target=until_closed, daemon=True).start()
        while (response := self.responses.get()) is not None:
            yield service_pb2.ModelStreamInferResponse(infer_response=response)


class WithFeed(Scripted):
    """Scripted, and a decode feed (tensors.DECODE_FEED_OPEN) answered from `feed_responses`."""

    def __init__(self):
        super().__init__()
        self.feed_responses: queue.Queue = queue.Queue()
        self.feed_requests: list[service_pb2.ModelInferRequest] = []

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        first = next(request_iterator)
        if tensors.DECODE_FEED_OPEN not in first.parameters:
            yield from self._answer(first, request_iterator)
            return
        self.feed_requests.append(first)
        while (response := self.feed_responses.get()) is not None:
            yield service_pb2.ModelStreamInferResponse(infer_response=response)


def response(text: str | None, final: bool = False, **more: np.ndarray) -> service_pb2.ModelInferResponse:
    """A chat response carrying `text` as its `response` JSON, or none (a heartbeat), and
    `more` outputs by name."""
    reply = service_pb2.ModelInferResponse(model_name="chat")
    reply.parameters["triton_final_response"].bool_param = final
    arrays = {tensors.RESPONSE: np.array([text.encode()], dtype=np.object_)} if text is not None else {}
    for name, array in {**arrays, **more}.items():
        datatype, content = raw_tensor(array)
        reply.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        reply.raw_output_contents.append(content)
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


def serving(servicer, *ends: queue.Queue):
    """A fixture's body: `servicer` served; after the test, each of `ends` ended, then the server."""
    server, url = serve(servicer)
    yield url, servicer
    for end in ends:
        end.put(None)
    server.stop(grace=None)


@pytest.fixture
def scripted_server():
    servicer = Scripted()
    yield from serving(servicer, servicer.responses)


@pytest.fixture
def feed_server():
    servicer = WithFeed()
    yield from serving(servicer, servicer.responses, servicer.feed_responses)


def threads() -> int:
    """This client's threads (the stand-in server's pool left out)."""
    return sum(not thread.name.startswith("ThreadPoolExecutor") for thread in threading.enumerate())


def test_a_stalled_stream_leaves_no_thread_behind(silent_server):
    url, servicer = silent_server
    chat = GrpcChat(url, timeout_s=0.2)
    with pytest.raises(ServerSilent):  # the first starts the streams' loop and gRPC's poller
        list(chat.stream(chat_inputs(HI)))
    before = threads()
    for _ in range(3):
        with pytest.raises(ServerSilent):
            list(chat.stream(chat_inputs(HI)))
    assert wait_for(lambda: threads() == before and servicer.open == 0, timeout=5)
    chat.close()


def test_a_stream_cancelled_from_another_thread_leaves_no_thread_behind(silent_server):
    url, servicer = silent_server
    chat = GrpcChat(url, timeout_s=0.2)
    with pytest.raises(ServerSilent):  # the first starts the streams' loop and gRPC's poller
        list(chat.stream(chat_inputs(HI)))
    chat.timeout_s = 30
    assert wait_for(lambda: servicer.open == 0, timeout=5)
    before = threads()
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
    assert wait_for(lambda: threads() == before and servicer.open == 0, timeout=5)
    chat.close()


def test_an_async_stream_cancelled_on_its_loop_cancels_its_request(silent_server):
    """As a front's request task is when its client leaves: no thread takes part."""
    url, servicer = silent_server
    chat = GrpcChat(url, timeout_s=30)

    async def leave() -> None:
        before = threads()
        reading = asyncio.ensure_future(anext(chat.astream(chat_inputs(HI))))
        while servicer.open == 0:
            await asyncio.sleep(0.02)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        while servicer.open:
            await asyncio.sleep(0.02)
        assert threads() == before

    asyncio.run(asyncio.wait_for(leave(), 10))
    chat.close()


def test_an_output_carries_its_ids_and_finish_reason(scripted_server):
    url, servicer = scripted_server
    chat = GrpcChat(url, timeout_s=10)
    outputs = chat.stream(chat_inputs(HI))
    ids = np.array([7, 8, 9], dtype=np.int32)
    servicer.responses.put(
        response(
            '{"n": 0}',
            final=True,
            **{
                tensors.PROMPT_TOKEN_IDS: ids,
                tensors.FINISH_REASON: np.array([b"length"], dtype=np.object_),
            },
        )
    )
    [output] = list(outputs)
    assert output.prompt_token_ids == [7, 8, 9] and output.finish_reason == "length"
    assert output.output_token_ids == [] and output.text == ""  # outputs not sent read as empty
    chat.close()


def test_a_ticket_sends_decode_its_request_on_the_same_stream(scripted_server):
    url, servicer = scripted_server
    chat = GrpcChat(url, timeout_s=10, decode_direct=True)
    outputs = chat.stream(chat_inputs(HI))
    ids = np.array([1, 2], dtype=np.int32)
    ticket = {tensors.STAGE_SEAL: np.array([b"seal"], dtype=np.object_), tensors.PROMPT_TOKEN_IDS: ids}
    servicer.responses.put(response(None, **ticket))
    servicer.responses.put(response('{"n": 0}', final=True))
    assert [output.response for output in outputs] == [{"n": 0}]
    assert wait_for(lambda: len(servicer.requests) == 2, timeout=5)
    chat_request, decode_request = servicer.requests
    assert chat_request.model_name == DEFAULT_MODEL and chat_request.parameters[tensors.DECODE_TICKET].bool_param
    assert decode_request.model_name == tensors.DECODE
    sent = {
        tensor.name: raw for tensor, raw in zip(decode_request.inputs, decode_request.raw_input_contents, strict=True)
    }
    assert np.frombuffer(sent[tensors.PROMPT_TOKEN_IDS], dtype=np.int32).tolist() == [1, 2]
    chat.close()


def test_a_cancel_before_the_stream_starts_cancels_it(silent_server):
    """As a router's abort or a leaving client may, between taking a client and its first `next`."""
    url, servicer = silent_server
    chat = GrpcChat(url, timeout_s=30)
    chat.cancel()
    started = time.monotonic()
    with pytest.raises(ChatError, match="cancelled"):
        list(chat.stream(chat_inputs(HI)))
    assert time.monotonic() - started < 5
    chat.forget_cancel()
    chat.cancel()
    chat.forget_cancel()  # a pooled client: what came after its stream is dropped
    chat.timeout_s = 0.2
    with pytest.raises(ServerSilent):
        list(chat.stream(chat_inputs(HI)))
    chat.close()


def strings(*values: str) -> np.ndarray:
    return np.array([value.encode() for value in values], dtype=np.object_)


def fed_response(*outputs: tuple[str, str]) -> service_pb2.ModelInferResponse:
    """A response of decode's feed: (key, RESPONSE JSON) of each stream."""
    fed = service_pb2.ModelInferResponse(model_name="decode")
    fed.parameters["triton_final_response"].bool_param = False
    for name, values in (
        (tensors.FEED_KEYS, [k for k, _ in outputs]),
        (tensors.FEED_RESPONSES, [b for _, b in outputs]),
    ):
        datatype, content = raw_tensor(strings(*values))
        fed.outputs.add(name=name, datatype=datatype, shape=[len(outputs)])
        fed.raw_output_contents.append(content)
    return fed


def final_response() -> service_pb2.ModelInferResponse:
    """A feed's last response: no outputs, the final flag (decode closed or refused it)."""
    final = service_pb2.ModelInferResponse(model_name="decode")
    final.parameters["triton_final_response"].bool_param = True
    return final


def fed_stream(feed_server, grant: bool = True):
    """A front's answer (read on a thread into `taken`) whose chat answered with a ticket
    (and a feed grant, with `grant`); returns its thread, `taken`, and decode's request."""
    url, servicer = feed_server
    chat = GrpcChat(url, timeout_s=10, outputs=tensors.FRONT_OUTPUTS, decode_direct=True)
    taken: list = []

    def read():
        try:
            taken.extend(o.response for o in chat.stream(chat_inputs(HI)))
        except ChatError as exc:
            taken.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert wait_for(lambda: len(servicer.requests) == 1, timeout=5)
    asked = servicer.requests[0].parameters[tensors.DECODE_FEED_GRANT].string_param
    assert asked  # no feed of this server yet: the answer asks chat for a grant
    ticket = {tensors.STAGE_SEAL: strings("seal"), **({tensors.FEED_SEAL: strings("grant")} if grant else {})}
    servicer.responses.put(response(None, **ticket))
    assert wait_for(lambda: len(servicer.requests) == 2, timeout=5)
    return reader, taken, servicer.requests[1]


def test_a_fed_answer_s_last_output_waits_for_those_its_feed_brings(feed_server):
    """The feed and an answer's own stream are not ordered against each other: the last output
    says how many came through the feed, and goes to the caller after them."""
    _, servicer = feed_server
    reader, taken, decode_request = fed_stream(feed_server)
    assert wait_for(lambda: len(servicer.feed_requests) == 1, timeout=5)
    [opened] = servicer.feed_requests  # opened with chat's grant, under the name the grant was asked for
    assert opened.parameters[tensors.DECODE_FEED_OPEN].string_param == (
        servicer.requests[0].parameters[tensors.DECODE_FEED_GRANT].string_param
    )
    assert opened.raw_input_contents[0].endswith(b"grant")
    key = decode_request.parameters[tensors.DECODE_FEED_KEY].string_param
    assert (
        decode_request.parameters[tensors.DECODE_FEED].string_param
        == opened.parameters[tensors.DECODE_FEED_OPEN].string_param
    )
    assert key and tensors.FED_OUTPUTS in [output.name for output in decode_request.outputs]
    servicer.responses.put(response('{"n": 2}', final=True, **{tensors.FED_OUTPUTS: np.array([2], dtype=np.int32)}))
    time.sleep(0.3)
    assert taken == []  # held for the two the feed has not brought yet
    servicer.feed_responses.put(fed_response((key, '{"n": 0}'), ("another", '{"x": 1}')))
    servicer.feed_responses.put(fed_response((key, '{"n": 1}'), ("another", '{"x": 2}')))
    reader.join(5)
    assert taken == [{"n": 0}, {"n": 1}, {"n": 2}]  # another stream's outputs not among them


def test_an_answer_whose_feed_is_refused_streams_unfed(feed_server):
    """decode refuses a feed (every one of its feeds carries streams): the answer does not
    fail; decode, not holding the feed, sends every output on the answer's own stream."""
    _, servicer = feed_server
    reader, taken, _ = fed_stream(feed_server)
    servicer.feed_responses.put(final_response())  # the feed ends at once
    servicer.responses.put(response('{"n": 0}'))
    servicer.responses.put(response('{"n": 1}', final=True, **{tensors.FED_OUTPUTS: np.array([0], dtype=np.int32)}))
    reader.join(5)
    assert taken == [{"n": 0}, {"n": 1}]


def test_an_answer_whose_fed_outputs_the_feed_lost_fails_unavailable(feed_server):
    _, servicer = feed_server
    reader, taken, decode_request = fed_stream(feed_server)
    key = decode_request.parameters[tensors.DECODE_FEED_KEY].string_param
    servicer.feed_responses.put(fed_response((key, '{"n": 0}')))
    assert wait_for(lambda: len(taken) == 1, timeout=5)
    servicer.feed_responses.put(final_response())  # the feed ends; it owed the answer one more output
    servicer.responses.put(response('{"n": 2}', final=True, **{tensors.FED_OUTPUTS: np.array([2], dtype=np.int32)}))
    reader.join(5)
    *outputs, error = taken
    assert isinstance(error, ChatError) and error.code is ErrorCode.UNAVAILABLE and "decode feed" in str(error)
    assert outputs == [{"n": 0}]


def test_an_answer_without_a_grant_goes_unfed(feed_server):
    """A chat that grants no feed (an older server, or a refusal): decode is asked for no feed."""
    _, servicer = feed_server
    reader, taken, decode_request = fed_stream(feed_server, grant=False)
    assert tensors.DECODE_FEED not in decode_request.parameters and servicer.feed_requests == []
    servicer.responses.put(response('{"n": 0}', final=True))
    reader.join(5)
    assert taken == [{"n": 0}]
