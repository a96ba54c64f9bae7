"""Chat with `chat_ensemble` (or `chat`) over tritonclient gRPC streaming or HTTP generate.

Both transports return the same `ChatOutput` per Triton response, so callers (the CLI,
tests, benchmarks) do not care which one carried it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from tritonclient.grpc import InferResult

from pdchat import tensors
from pdchat.clients.decode_feed import DecodeFeed, new_feed_id
from pdchat.clients.grpc_streams import StreamCall, StreamLoop, infer_request, output_values
from pdchat.core.errors import ErrorCode, PdchatError, parse_tag
from pdchat.core.output.responses import FAILED

DEFAULT_MODEL = "chat"
# Longest wait for a server's next response (a front passes its own stall deadline).
TIMEOUT_S = 60.0


class ChatError(PdchatError):
    """The server refused or failed the request; the message is the server's, `code` its
    code (from the gRPC or HTTP status, or the message's tag; INTERNAL when none says)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL):
        super().__init__(message)
        self.code = code

    @property
    def is_client_error(self) -> bool:
        return self.code.is_client_error


class ServerSilent(ChatError):
    """The server sent no response (the first, or the next) within the client's `timeout_s`."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.UNAVAILABLE)


@dataclass(frozen=True)
class ChatOutput:
    """One response of the stream (or the only one, when not streaming).

    The JSON texts stay as the server sent them: a router forwards them without parsing.
    """

    text: str
    response_json: str
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    kv_transfer_params_json: str = ""  # from a prefill (do_remote_decode) answer

    @cached_property
    def response(self) -> dict[str, Any]:
        return json.loads(self.response_json) if self.response_json else {}

    @cached_property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return json.loads(self.kv_transfer_params_json) if self.kv_transfer_params_json else None


# One request's outputs, taken on an event loop (GrpcChat.astream, a front's `chat`).
ChatStream = AsyncGenerator[ChatOutput, None]


@dataclass(frozen=True)
class ChatResult:
    """A whole answer, however many responses carried it."""

    outputs: list[ChatOutput]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def output_token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.output_token_ids]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.outputs[0].prompt_token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str:
        return self.outputs[-1].finish_reason if self.outputs else ""


def chat_inputs(
    request: dict[str, Any] | str | bytes | None = None,
    text_input: str | None = None,
    *,
    prompt_token_ids: list[int] | np.ndarray | None = None,
    kv_transfer_params: dict[str, Any] | str | bytes | None = None,
    form: str = tensors.REQUEST,
    **scalars: Any,
) -> dict[str, np.ndarray]:
    """The client contract's input tensors, by name: a JSON body (dict, or str/bytes sent
    as is) as input `form` (tensors.REQUEST: chat; tensors.COMPLETION_REQUEST: completions,
    `chat` only) or text_input + scalars; forwarded ids and kv_transfer_params for `chat`."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in ((form, request), (tensors.KV_TRANSFER_PARAMS, kv_transfer_params)):
        if value is not None:
            if isinstance(value, dict):
                value = json.dumps(value)
            arrays[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
    if prompt_token_ids is not None:
        arrays[tensors.PROMPT_TOKEN_IDS] = np.asarray(prompt_token_ids, dtype=np.int32)
    if text_input is not None:
        arrays[tensors.TEXT_INPUT] = np.array([text_input.encode()], dtype=np.object_)
    for name, value in scalars.items():
        if value is not None:
            arrays[name] = np.array([value], dtype=tensors.SCALAR_INPUTS[name])
    return arrays


def collect(outputs: Iterator[ChatOutput]) -> ChatResult:
    return ChatResult(list(outputs))


def _to_output(get: Callable[[str], Any]) -> ChatOutput:
    """One response from `get(output name)`, which gives None for absent outputs."""

    def text(name: str) -> str:
        value = get(name)
        value = value[0] if isinstance(value, (list, np.ndarray)) else value
        return value.decode() if isinstance(value, bytes) else str(value or "")

    def ids(name: str) -> list[int]:
        value = get(name)
        if value is None:
            return []
        if isinstance(value, list) and (not value or isinstance(value[0], int)):
            return value
        return [int(v) for v in np.asarray(value).reshape(-1)]

    body, handoff = text(tensors.RESPONSE), text(tensors.KV_TRANSFER_PARAMS)
    if text(tensors.FINISH_REASON) == FAILED:  # a stream that failed mid-way (chat_ensemble, decode)
        raise _tagged_error(json.loads(body)["error"]["message"])
    return ChatOutput(
        text(tensors.TEXT_OUTPUT),
        body,
        ids(tensors.PROMPT_TOKEN_IDS),
        ids(tensors.OUTPUT_TOKEN_IDS),
        text(tensors.FINISH_REASON),
        handoff,
    )


class _Arrival:
    """A response of a stream (a ModelInferResponse) or its error, read as it arrives; or
    (`fed`) an output that came through decode's feed; or (`feed_end`) the end of that feed."""

    __slots__ = ("response", "error", "final", "values", "is_ticket", "through_feed", "fed_outputs", "feed_ended")

    def __init__(self, response: Any, error: Any):
        self.response, self.error = response, error
        self.final = error is None and response.parameters["triton_final_response"].bool_param
        self.values = {} if error is not None or not response.outputs else output_values(response)
        self.is_ticket = tensors.STAGE_SEAL in self.values  # chat's ticket: decode's sealed inputs
        self.through_feed = False
        self.fed_outputs = self.values.get(tensors.FED_OUTPUTS, [0])[0]  # a fed stream's last: the feed's count
        self.feed_ended: Any = None  # the cause, when the stream's feed ended

    @classmethod
    def fed(cls, body: bytes) -> _Arrival:
        """An output of the stream that decode's feed brought (its RESPONSE JSON only)."""
        return cls._from_feed({tensors.RESPONSE: [body]}, through_feed=True, feed_ended=None)

    @classmethod
    def feed_end(cls, cause: Any) -> _Arrival:
        """The stream's feed ended (`cause`): outputs it still owed the stream are lost."""
        return cls._from_feed({}, through_feed=False, feed_ended=cause)

    @classmethod
    def _from_feed(cls, values: dict[str, Any], *, through_feed: bool, feed_ended: Any) -> _Arrival:
        arrival = cls.__new__(cls)
        arrival.response = arrival.error = None
        arrival.final = arrival.is_ticket = False
        arrival.values, arrival.through_feed, arrival.feed_ended, arrival.fed_outputs = (
            values,
            through_feed,
            feed_ended,
            0,
        )
        return arrival


class GrpcChat:
    """gRPC streaming: works for streamed and whole answers of decoupled models. One stream
    at a time: `astream` on an event loop (a front's), or `stream` from any other thread,
    both running it on the process's stream loop (clients/grpc_streams.py).
    `timeout_s`: the longest wait for a response (the first, or the next); `outputs`: the
    outputs a stream requests (None: all; absent ones read as empty).

    `decode_direct` (model `chat` only): ask chat for a ticket (tensors.DECODE_TICKET) and
    stream the answer from `decode` itself, on the same gRPC stream; a route that answers
    without decode (a prefill leg) answers as it always does. Such answers take their
    outputs but the last through the server's decode feed (pdchat.clients.decode_feed)
    where `outputs` names no output but the response JSON, finish reason and KV transfer
    params (tensors.FRONT_OUTPUTS, the fronts'): a fed output carries its response JSON only.
    An answer whose feed could not be opened, or ended before carrying any of its outputs, is
    streamed unfed; one whose fed outputs the feed's end lost fails Unavailable."""

    def __init__(
        self,
        url: str,
        model: str = DEFAULT_MODEL,
        timeout_s: float = TIMEOUT_S,
        outputs: tuple[str, ...] | None = None,
        decode_direct: bool = False,
    ):
        import tritonclient.grpc as grpcclient

        if decode_direct and model != DEFAULT_MODEL:
            raise ValueError(f"decode_direct takes tickets from model {DEFAULT_MODEL!r}, not {model!r}")
        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self.decode_direct = decode_direct
        # What a fed output gives in full: its JSON; the others are empty until an answer's last.
        fed_only = {tensors.RESPONSE, tensors.FINISH_REASON, tensors.KV_TRANSFER_PARAMS}
        fed_ready = outputs is not None and set(outputs) <= fed_only
        self.decode_feed = decode_direct and fed_ready
        wanted = outputs
        if outputs is not None and decode_direct:  # chat's answer may be a ticket, with a feed grant
            grant = (tensors.FEED_SEAL,) if self.decode_feed else ()
            wanted = tuple(dict.fromkeys(outputs + tensors.DECODE_TICKET_OUTPUTS + grant))
        self._outputs = None if wanted is None else list(wanted)
        # What the caller asked for: chat's outputs before a ticket carry no ticket-only output it did not.
        self._asked = None if outputs is None else frozenset(outputs)
        self._decode_outputs = None  # None: every output of decode (all client outputs)
        if outputs is not None:
            self._decode_outputs = [name for name in outputs if name in tensors.CLIENT_OUTPUTS]
        if self.decode_feed:
            self._decode_outputs = [*self._decode_outputs, tensors.FED_OUTPUTS]
        self._call: StreamCall | None = None  # the running stream
        # cancel() came before the stream's call was made: the call is cancelled once made.
        self._cancel_pending = False
        self._call_lock = threading.Lock()

    def stream(
        self, inputs: dict[str, np.ndarray], request_id: str = "", parameters: dict[str, Any] | None = None
    ) -> Iterator[ChatOutput]:
        """`astream` for a caller on no event loop: its steps run on this process's stream loop."""
        return StreamLoop.shared().iterate(self.astream(inputs, request_id, parameters))

    async def astream(
        self, inputs: dict[str, np.ndarray], request_id: str = "", parameters: dict[str, Any] | None = None
    ) -> ChatStream:
        """The responses to one request (`parameters`: request parameters of chat beside those
        the client sets itself), on the running event loop, whose stream loop runs the stream
        (StreamLoop.running). Leaving early (closing or cancelling it) cancels the request."""
        responses: asyncio.Queue[_Arrival] = asyncio.Queue()
        call = StreamLoop.running().open(self.url, functools.partial(self._arrived, responses))
        with self._call_lock:
            self._call, cancelled, self._cancel_pending = call, self._cancel_pending, False
        if cancelled:  # the reader reports the cancellation, as for a stream cancelled later
            call.cancel()
        finished = False
        # A whole answer comes at its end: empty responses meanwhile keep it inside timeout_s.
        heartbeats = {tensors.HEARTBEAT_MS: max(1, round(1000 * self.timeout_s / 3))}
        ticketed = False  # chat answered with a ticket: the responses from here on are decode's
        feed, feed_key = None, ""  # decode's feed this answer's outputs come through (decode_feed)
        fed = 0  # outputs taken from the feed
        feed_lost = None  # the feed's end, once it ended: what it still owed is lost
        last: _Arrival | None = None  # the last output, come before some of those the feed sent
        grant_id = None  # the feed this answer asks chat to grant, when its server has none open
        try:
            try:
                chat_parameters = {**heartbeats, **(parameters or {})}
                if self.decode_direct:
                    chat_parameters[tensors.DECODE_TICKET] = True
                if self.decode_feed and DecodeFeed.wants_grant(self.url):
                    grant_id = chat_parameters[tensors.DECODE_FEED_GRANT] = new_feed_id()
                call.write(infer_request(self.model, inputs, self._outputs, request_id, chat_parameters))
            except Exception as exc:  # noqa: BLE001 - a request that cannot be built (its inputs or parameters)
                finished = True
                raise ChatError(f"the request could not be sent: {exc}", ErrorCode.INVALID_ARG) from exc
            while True:
                arrival = await self._next(responses)
                if arrival.error is not None:
                    finished = True  # an error ends the request
                    raise _grpc_error(arrival.error)
                if self.decode_direct and not ticketed and arrival.is_ticket:
                    ticketed = True
                    ticket = InferResult(arrival.response)
                    arrays = {name: ticket.as_numpy(name) for name in tensors.DECODE_TICKET_OUTPUTS}
                    decode_inputs = {name: array for name, array in arrays.items() if array is not None}
                    decode_parameters: dict[str, Any] = {**heartbeats, **_for_decode(parameters)}
                    feed = self._feed(ticket, grant_id)
                    if feed is not None:
                        feed_key = feed.register(
                            functools.partial(self._fed, responses), functools.partial(self._feed_ended, responses)
                        )
                        feed_parameters = {tensors.DECODE_FEED: feed.id, tensors.DECODE_FEED_KEY: feed_key}
                        decode_parameters = {**decode_parameters, **feed_parameters}
                    decode = infer_request(
                        tensors.DECODE, decode_inputs, self._decode_outputs, request_id, decode_parameters
                    )
                    call.write(decode)
                    continue
                if arrival.feed_ended is not None:
                    feed_lost = arrival.feed_ended
                if feed_lost is not None and (last or arrival).fed_outputs > fed:
                    finished = last is not None or arrival.final  # else leaving cancels it on the server
                    raise ChatError(
                        f"the decode feed from {self.url} ended mid-answer: {feed_lost.message()}",
                        ErrorCode.UNAVAILABLE,
                    )
                if arrival.through_feed:
                    fed += 1
                elif arrival.final and arrival.fed_outputs > fed:
                    last = arrival  # the feed's outputs before it are on their way
                    continue
                if arrival.values:  # not a heartbeat, nor the bare final flag
                    yield self._output(arrival.values)
                if last is not None and fed >= last.fed_outputs:
                    arrival = last
                    if arrival.values:
                        yield self._output(arrival.values)
                if arrival.final:
                    finished = True
                    return
        finally:
            # Leaving early (client gone) cancels the request on the server; cancelling a
            # finished one would race its completion, so only unfinished ones are cancelled.
            if feed is not None:
                feed.unregister(feed_key)
            with self._call_lock:
                self._call = None
            call.cancel() if not finished else call.close()

    async def _next(self, responses: asyncio.Queue[_Arrival]) -> _Arrival:
        """The stream's next arrival; ServerSilent after `timeout_s` without one (unfinished:
        leaving then cancels the request on the server)."""
        if not responses.empty():
            return responses.get_nowait()
        try:
            return await asyncio.wait_for(responses.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise ServerSilent(f"{self.url} sent nothing for {self.timeout_s:g} s") from None

    def _output(self, values: dict[str, Any]) -> ChatOutput:
        """One response's outputs, only those the caller asked for: with decode_direct chat is
        also asked for the ticket's, and a first output it sends before the ticket has them."""
        asked = self._asked
        if asked is None:
            return _to_output(values.get)
        return _to_output(lambda name: values.get(name) if name in asked else None)

    def _arrived(self, responses: asyncio.Queue[_Arrival], response: Any, error: Any) -> None:  # on the loop
        responses.put_nowait(_Arrival(response, error))

    def _feed(self, ticket: InferResult, grant_id: str | None) -> DecodeFeed | None:
        """The feed a ticket's answer comes through: its server's open one, else the one
        this answer's grant opens; None when the answer goes unfed."""
        if not self.decode_feed:
            return None
        feed = DecodeFeed.current(self.url)
        grant = ticket.as_numpy(tensors.FEED_SEAL)
        if feed is None and grant_id is not None and grant is not None:
            feed = DecodeFeed.open_with(self.url, grant_id, grant[0].decode())
        return feed

    def _fed(self, responses: asyncio.Queue[_Arrival], body: bytes) -> None:  # on the loop
        responses.put_nowait(_Arrival.fed(body))

    def _feed_ended(self, responses: asyncio.Queue[_Arrival], cause: Any) -> None:  # on the loop
        responses.put_nowait(_Arrival.feed_end(cause))

    def forget_cancel(self) -> None:
        """Drop a cancel() that came after the last stream ended (before its caller let go
        of this client): a pooled client's next stream must not inherit it."""
        with self._call_lock:
            self._cancel_pending = False

    def cancel(self) -> None:
        """Close the running stream from any thread, its request cancelled on the server: the
        stream's reader ends with the cancellation as its error. A stream whose call is not
        made yet (its `next` is on the way there) is cancelled as soon as it is."""
        with self._call_lock:
            call = self._call
            if call is None:
                self._cancel_pending = True
        if call is not None:
            call.cancel()

    def answer(self, model: str, name: str, body: bytes, request_id: str = "") -> dict[str, Any]:
        """The JSON `response` a non-decoupled `model` answers to one JSON input `name` (the
        renderer's tokenize_request, detokenize_request); its error as a ChatError."""
        tensor = self._grpc.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([body], dtype=np.object_))
        try:
            result = self.client.infer(
                model,
                [tensor],
                outputs=[self._grpc.InferRequestedOutput(tensors.RESPONSE)],
                request_id=request_id,
                client_timeout=self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - tritonclient raises several kinds
            raise _grpc_error(exc) from exc
        return json.loads(result.as_numpy(tensors.RESPONSE)[0])

    def close(self) -> None:
        self.client.close()


class HttpChat:
    """HTTP generate (one JSON answer) and generate_stream (server-sent events)."""

    def __init__(self, url: str, model: str = DEFAULT_MODEL):
        self.base = f"http://{url}/v2/models/{model}"
        self.model = model

    def stream(self, inputs: dict[str, np.ndarray], request_id: str = "") -> Iterator[ChatOutput]:
        body = {name: _json_value(array) for name, array in inputs.items()}
        if request_id:
            body["id"] = request_id
        streaming = bool(inputs.get(tensors.STREAM, [False])[0]) or _json_streams(inputs)
        request = urllib.request.Request(
            f"{self.base}/{'generate_stream' if streaming else 'generate'}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                if not streaming:
                    yield _from_json(json.loads(reply.read()))
                    return
                for line in reply:
                    if line.startswith(b"data:"):
                        yield _from_json(json.loads(line[5:]))
        except urllib.error.HTTPError as exc:
            code, message = parse_tag(_http_error_message(exc))
            raise ChatError(message, code or ErrorCode.from_http_status(exc.code)) from exc
        except OSError as exc:
            raise ChatError(f"{self.base} unreachable: {exc}", ErrorCode.UNAVAILABLE) from exc

    def close(self) -> None:
        pass


def _from_json(event: dict[str, Any]) -> ChatOutput:
    if "error" in event:
        raise _tagged_error(event["error"])
    return _to_output(event.get)


def _tagged_error(message: str) -> ChatError:
    """A pdchat message that carries its code in its tag (core.errors)."""
    code, message = parse_tag(message)
    return ChatError(message, code or ErrorCode.INTERNAL)


def _grpc_error(error: Any) -> ChatError:
    """A tritonclient error. Errors inside a gRPC stream come without a status: then the
    tag at the front of pdchat's message gives the code."""
    message = error.message() if hasattr(error, "message") else str(error)
    status = str((error.status() if hasattr(error, "status") else "") or "").removeprefix("StatusCode.")
    code, message = parse_tag(message or str(error))
    if code is ErrorCode.NOT_FOUND:  # pdchat's NOT_FOUND is known by its tag (ErrorCode.from_grpc_status)
        return ChatError(message, code)
    return ChatError(message, ErrorCode.from_grpc_status(status) if status else code or ErrorCode.INTERNAL)


def _http_error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read()).get("error", str(exc))
    except ValueError:
        return str(exc)


def _json_streams(inputs: dict[str, np.ndarray]) -> bool:
    """Whether the JSON body asks to stream; a body that is no JSON object is the server's to refuse."""
    try:
        body = json.loads(inputs[tensors.REQUEST][0])
    except (KeyError, ValueError):
        return False
    return isinstance(body, dict) and body.get("stream") is True


def _json_value(array: np.ndarray) -> Any:
    """A [1] tensor as a JSON scalar, longer ones (token ids) as a list."""
    if array.shape != (1,):
        return array.tolist()
    value = array[0]
    return value.decode() if isinstance(value, bytes) else value.item()


def connect(url: str, protocol: str = "grpc", model: str = DEFAULT_MODEL) -> GrpcChat | HttpChat:
    if protocol == "grpc":
        return GrpcChat(url, model)
    if protocol == "http":
        return HttpChat(url, model)
    raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")


def _for_decode(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """Of chat's request parameters, those a ticket's decode request carries as well."""
    return {name: value for name, value in (parameters or {}).items() if name == tensors.KV_OWNER}
