"""A front's feed from a server's decode model (tensors.DECODE_FEED_OPEN).

Streams that take their answer from decode itself (tickets) name the feed of their server,
and decode sends their outputs but the last through it, one response per decode step for
all of them, instead of one response per output on each stream. The feed hands each output
to the stream that registered its key; the stream's last output still comes on the
stream itself, with the count of its outputs sent through the feed (GrpcChat waits for
them). One feed per server address and stream loop, opened on first use; one that ended is
replaced on the next use, and the streams registered when it ended hear of it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import numpy as np
from tritonclient.utils import InferenceServerException

from pdchat import tensors
from pdchat.clients.grpc_streams import StreamLoop, infer_request, output_values
from pdchat.core.errors import ErrorCode, tag

log = logging.getLogger(__name__)

# deliver(body): one output's RESPONSE JSON; ended(error): the feed ended before the stream.
Deliver = Callable[[bytes], None]
Ended = Callable[[InferenceServerException], None]


class DecodeFeed:
    _feeds: dict[tuple[int, str], DecodeFeed] = {}
    _feeds_lock = threading.Lock()

    @classmethod
    def of(cls, url: str) -> DecodeFeed:
        """The open feed from the decode model of the server at `url` on this process's
        stream loop, opened now if there is none."""
        streams = StreamLoop.shared()
        with cls._feeds_lock:
            feed = cls._feeds.get((id(streams), url))
            if feed is None or feed.ended:
                feed = cls._feeds[(id(streams), url)] = cls(streams, url)
            return feed

    def __init__(self, streams: StreamLoop, url: str):
        self.id = uuid.uuid4().hex
        self.url = url
        self.ended = False
        self._streams: dict[str, tuple[Deliver, Ended]] = {}
        self._call = streams.open(url, self._arrived)
        seal = {tensors.STAGE_SEAL: np.array([b""], dtype=np.object_)}  # a feed opens without a seal
        outputs = [tensors.FEED_KEYS, tensors.FEED_RESPONSES]
        self._call.write(infer_request(tensors.DECODE, seal, outputs, "", {tensors.DECODE_FEED_OPEN: self.id}))

    def register(self, deliver: Deliver, ended: Ended) -> str:
        """A new key: the outputs the feed brings for it go to `deliver`, and its end (if it
        comes first) to `ended`, both on the stream loop's thread."""
        key = uuid.uuid4().hex
        self._streams[key] = (deliver, ended)
        return key

    def unregister(self, key: str) -> None:
        self._streams.pop(key, None)

    def _arrived(self, response, error: InferenceServerException | None) -> None:  # on the loop's thread
        if error is None and response.outputs:
            values = output_values(response)
            for key, body in zip(values[tensors.FEED_KEYS], values[tensors.FEED_RESPONSES], strict=True):
                stream = self._streams.get(key.decode())
                if stream is not None:  # not one whose caller left meanwhile
                    stream[0](body)
            return
        if error is None and not response.parameters["triton_final_response"].bool_param:
            return  # an empty response that is not the last (none is sent today)
        self.ended = True
        if error is None:  # decode closed it: so does this end of the stream
            self._call.close()
        cause = error or InferenceServerException(msg="decode closed the feed")
        log.warning("decode feed from %s ended: %s", self.url, cause)
        lost = InferenceServerException(
            msg=tag(ErrorCode.UNAVAILABLE, f"the decode feed from {self.url} ended mid-answer: {cause.message()}")
        )
        for _, ended in list(self._streams.values()):
            ended(lost)
        self._streams.clear()
