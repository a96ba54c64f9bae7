"""Triton's gRPC streaming (ModelStreamInfer) on one asyncio loop for the whole process.

tritonclient's synchronous stream starts two threads per stream (its reader and gRPC's
request feeder) and hands every response across three threads before its callback runs.
Here every stream's reads and writes run as tasks on one event loop: a response reaches
its callback on that loop's thread, the first thread that sees it. A front with tens of
streams and a token per response per stream spends much less CPU this way
(docs/benchmarks.md, "Steps on the per-token path").

Callers on any thread use `StreamCall`: `write` and `cancel` are handed to the loop and
return at once (never blocking, so the loop's own thread may call them too); responses
and the stream's end come to `on_response(result, error)` on the loop's thread, which
must not block. A caller on no event loop takes an async generator of the loop's (such as
GrpcChat.astream) with `iterate`. No Triton server import here: the loop, its channels and
calls are plain grpc.aio.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from typing import Any, TypeVar

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    np_to_triton_dtype,
    serialize_byte_tensor,
    triton_to_np_dtype,
)

log = logging.getLogger(__name__)

# As tritonclient's channels: no message size limit of gRPC's own.
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
# What a stream's reader reports when the stream was cancelled here (as tritonclient words it).
CANCELLED_MESSAGE = "Locally cancelled by application!"

T = TypeVar("T")
OnResponse = Callable[[service_pb2.ModelInferResponse | None, InferenceServerException | None], None]


def raw_tensor(array: np.ndarray) -> tuple[str, bytes]:
    """`array`'s Triton datatype and raw contents, as a request's input or a response's output
    carries them (object arrays as BYTES: each element length-prefixed)."""
    if array.dtype == np.object_:
        serialized = serialize_byte_tensor(array)
        return "BYTES", serialized.item() if serialized.size else b""
    return np_to_triton_dtype(array.dtype), np.ascontiguousarray(array).tobytes()


def output_values(response: Any) -> dict[str, list[Any]]:
    """A ModelInferResponse's outputs by name, each a flat list: BYTES as bytes, numbers as
    Python numbers (read straight from the raw contents: a streamed token's response is
    parsed once, on the loop that received it)."""
    if len(response.raw_output_contents) != len(response.outputs):  # not the raw form Triton sends
        result = InferResult(response)
        return {out.name: np.asarray(result.as_numpy(out.name)).reshape(-1).tolist() for out in response.outputs}
    values: dict[str, list[Any]] = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if output.datatype == "BYTES":
            values[output.name] = deserialize_bytes_tensor(raw).tolist()
        else:
            values[output.name] = np.frombuffer(raw, dtype=triton_to_np_dtype(output.datatype)).tolist()
    return values


def infer_request(
    model: str,
    arrays: Mapping[str, np.ndarray],
    outputs: list[str] | None,
    request_id: str,
    parameters: Mapping[str, Any],
) -> service_pb2.ModelInferRequest:
    """One ModelInferRequest: `arrays` as its inputs by name (object arrays as BYTES),
    `outputs` the outputs asked for (None: all), `parameters` its request parameters
    (bool, int, float or str), and an empty final response asked for."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        datatype, content = raw_tensor(array)
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(content)
    for name in outputs or ():
        request.outputs.add(name=name)
    for key, value in parameters.items():
        parameter = request.parameters[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            raise TypeError(f"request parameter {key!r} must be a bool, int, float or str, not {type(value).__name__}")
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


class StreamLoop:
    """The event loop every stream of this process runs on, with one channel per server
    address: a daemon thread's, started on first use and stopped at exit (`shared()`), or
    a running loop the process has already (`running()`), such as an HTTP front's.

    NOTE: channels and calls are only touched on the loop's thread."""

    _shared: StreamLoop | None = None
    _shared_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.new_event_loop()
        self._channels: dict[str, tuple[grpc.aio.Channel, service_pb2_grpc.GRPCInferenceServiceStub]] = {}
        self._thread: threading.Thread | None = None
        if loop is None:
            self._thread = threading.Thread(target=self._run, name="pdchat-grpc-streams", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    @classmethod
    def shared(cls) -> StreamLoop:
        """This process's loop: the last `running()` one while it runs, else a thread's."""
        with cls._shared_lock:
            if cls._shared is None or not (cls._shared.loop.is_running() or cls._shared._thread is not None):
                cls._shared = cls()
            return cls._shared

    @classmethod
    def running(cls) -> StreamLoop:
        """The running event loop's, which from now on runs the streams opened (an HTTP
        front's: responses reach their callbacks on its thread without a hop between
        threads). The streams of a loop before it keep running there."""
        loop = asyncio.get_running_loop()
        with cls._shared_lock:
            if cls._shared is None or cls._shared.loop is not loop:
                cls._shared = cls(loop)
            return cls._shared

    def iterate(self, outputs: AsyncGenerator[T, None]) -> Iterator[T]:
        """`outputs`, an async generator, taken by a caller on another thread: from its first
        `next` the loop runs it, handing each item over as it comes; leaving early cancels it
        there. Its error is raised to the caller."""
        if self._on_this_loop():  # it would wait for itself
            raise RuntimeError("a stream loop's own thread cannot wait for it: use the async generator")
        items: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()  # (done, item or error)

        async def run() -> None:
            try:
                async for item in outputs:
                    items.put((False, item))
                items.put((True, None))
            except BaseException as exc:
                items.put((True, exc))  # the caller's to raise
                if not isinstance(exc, Exception):
                    raise  # cancelled: the task ends so

        running = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            while True:
                done, item = items.get()
                if not done:
                    yield item
                elif item is not None:
                    raise item
                else:
                    return
        finally:
            running.cancel()  # a no-op once it ended

    def _on_this_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def open(self, url: str, on_response: OnResponse) -> StreamCall:
        """A new stream to `url`'s ModelStreamInfer; nothing is sent until its first `write`."""
        return StreamCall(self, url, on_response)

    def stub(self, url: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
        """`url`'s stub, its channel made on first use (on the loop's thread)."""
        if url not in self._channels:
            channel = grpc.aio.insecure_channel(url, options=_CHANNEL_OPTIONS)
            self._channels[url] = (channel, service_pb2_grpc.GRPCInferenceServiceStub(channel))
        return self._channels[url][1]

    def stop(self, timeout: float = 2.0) -> None:
        """Close the channels (ending their calls) and the loop's thread (a loop of its own)."""
        if self._thread is None or not self.loop.is_running():
            return

        async def close() -> None:
            for channel, _ in self._channels.values():
                await channel.close()
            self._channels.clear()
            # The streams' readers end with their channels, then their writers: let them.
            if tasks := asyncio.all_tasks() - {asyncio.current_task()}:
                await asyncio.wait(tasks, timeout=timeout / 2)

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout)
        except Exception:  # noqa: BLE001 - at exit: what did not close in time goes with the process
            log.debug("gRPC stream channels did not close in %s s", timeout, exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()


class StreamCall:
    """One ModelStreamInfer stream: requests written in order, every response (a
    ModelInferResponse; or the stream's end, as an error, when it ends other than by
    `close`) given to `on_response` on the loop's thread."""

    def __init__(self, streams: StreamLoop, url: str, on_response: OnResponse):
        self._streams, self._url, self._on_response = streams, url, on_response
        self._loop = streams.loop
        self._writes: asyncio.Queue | None = None  # made on the loop, with the call
        self._call: Any = None
        self._ended = False  # on the loop: the stream ended (closed, cancelled or broken)
        self._loop.call_soon_threadsafe(self._start)

    def write(self, request: service_pb2.ModelInferRequest) -> None:
        """Send `request` after those written before it (from any thread, at once)."""
        self._loop.call_soon_threadsafe(self._put, request)

    def close(self) -> None:
        """No more requests: the stream ends once the server answered those it has."""
        self._loop.call_soon_threadsafe(self._put, None)

    def cancel(self) -> None:
        """End the stream now, its requests cancelled on the server; its reader reports
        CANCELLED (CANCELLED_MESSAGE) unless it ended already."""
        self._loop.call_soon_threadsafe(self._cancel)

    # On the loop's thread:

    def _start(self) -> None:
        self._writes = asyncio.Queue()
        self._call = self._streams.stub(self._url).ModelStreamInfer()
        self._loop.create_task(self._write_all())
        self._loop.create_task(self._read_all())

    def _put(self, request: service_pb2.ModelInferRequest | None) -> None:
        if self._writes is not None:
            self._writes.put_nowait(request)

    def _cancel(self) -> None:
        if self._call is not None and not self._ended:
            self._call.cancel()

    async def _write_all(self) -> None:
        assert self._writes is not None
        try:
            while (request := await self._writes.get()) is not None:
                await self._call.write(request)
            await self._call.done_writing()
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.UsageError):
            pass  # the reader reports how the stream ended

    async def _read_all(self) -> None:
        error: InferenceServerException | None = None
        try:
            async for response in self._call:
                if response.error_message:
                    self._on_response(None, InferenceServerException(msg=response.error_message))
                else:
                    self._on_response(response.infer_response, None)
            code = await self._call.code()  # a cancelled call's responses just end
            if code == grpc.StatusCode.CANCELLED:
                error = _cancelled()
            elif code != grpc.StatusCode.OK:
                error = InferenceServerException(msg=await self._call.details(), status=str(code))
        except asyncio.CancelledError:
            error = _cancelled()
        except grpc.RpcError as exc:
            error = InferenceServerException(
                msg=exc.details(), status=str(exc.code()), debug_details=exc.debug_error_string()
            )
        finally:
            self._ended = True
            if self._writes is not None:
                self._writes.put_nowait(None)  # ends the writer
        if error is not None:
            self._on_response(None, error)


def _cancelled() -> InferenceServerException:
    return InferenceServerException(msg=CANCELLED_MESSAGE, status=str(grpc.StatusCode.CANCELLED))
