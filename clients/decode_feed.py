"""A front's feed from a server's decode model (tensors.DECODE_FEED_OPEN).

Streams that take their answer from decode itself (tickets) name the feed of their server,
and decode sends their outputs but the last through it, one response per decode step for
all of them, instead of one response per output on each stream. The feed hands each output
to the stream that registered its key; the stream's last output still comes on the
stream itself, with the count of its outputs sent through the feed (GrpcChat waits for
them, and fails the answer when the feed ended before bringing them all).

A feed opens with a grant: a stream that finds no open feed of its server (`current`)
asks chat for one with its ticket (tensors.DECODE_FEED_GRANT, naming the feed it would
open), and opens the feed with it (`open_with`) unless another stream opened one
meanwhile. One feed per server address and stream loop; one that ended is replaced by the
next grant, at most once per RETRY_S (decode refuses feeds while all of its own carry
streams: the streams of that while go unfed, on their own streams, as without a feed).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
from tritonclient.utils import InferenceServerException

from pdchat import tensors
from pdchat.clients.grpc_streams import StreamLoop, infer_request, output_values

log = logging.getLogger(__name__)

# deliver(body): one output's RESPONSE JSON; ended(cause): the feed ended before the stream.
Deliver = Callable[[bytes], None]
Ended = Callable[[InferenceServerException], None]


class DecodeFeed:
    RETRY_S = 1.0
    _feeds: dict[tuple[int, str], DecodeFeed] = {}
    _feeds_lock = threading.Lock()

    @classmethod
    def current(cls, url: str) -> DecodeFeed | None:
        """The open feed from the decode model of the server at `url` on this process's
        stream loop; None when there is none."""
        with cls._feeds_lock:
            feed = cls._feeds.get((id(StreamLoop.shared()), url))
            return None if feed is None or feed.ended else feed

    @classmethod
    def wants_grant(cls, url: str) -> bool:
        """True when a stream to the server at `url` should ask chat for a feed grant: no
        feed of it is open, and none was opened in the last RETRY_S."""
        with cls._feeds_lock:
            feed = cls._feeds.get((id(StreamLoop.shared()), url))
            return feed is None or (feed.ended and time.monotonic() - feed.opened_at >= cls.RETRY_S)

    @classmethod
    def open_with(cls, url: str, feed_id: str, grant: str) -> DecodeFeed:
        """The open feed from the server at `url`: the current one, else one opened now as
        `feed_id` with `grant`, chat's seal for it."""
        streams = StreamLoop.shared()
        with cls._feeds_lock:
            feed = cls._feeds.get((id(streams), url))
            if feed is None or feed.ended:
                feed = cls._feeds[(id(streams), url)] = cls(streams, url, feed_id, grant)
            return feed

    def __init__(self, streams: StreamLoop, url: str, feed_id: str, grant: str):
        self.id = feed_id
        self.url = url
        self.ended = False
        self.opened_at = time.monotonic()
        self._streams: dict[str, tuple[Deliver, Ended]] = {}
        self._call = streams.open(url, self._arrived)
        seal = {tensors.STAGE_SEAL: np.array([grant.encode()], dtype=np.object_)}
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
        for _, ended in list(self._streams.values()):
            ended(cause)
        self._streams.clear()


def new_feed_id() -> str:
    """A feed's id: random, so no other caller can name it."""
    return uuid.uuid4().hex
