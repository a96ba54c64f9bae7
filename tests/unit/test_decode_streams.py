"""decode's streams: each output goes once, in order, on its stream or its feed; a stream ends
once (finished, failed or cancelled), its feed place and its KV given back, its metrics told."""

import pytest

from pdchat.core.output.decode_streams import DecodeStream, DecodeStreams
from pdchat.core.output.feeds import DecodeFeeds
from pdchat.core.output.responses import ClientOutput, Delta


class Transport:
    """Records every response by sender: ("output", response JSON, final, fed), ("beat",),
    ("end", error) or ("fail", error)."""

    def __init__(self, broken: set[str] = frozenset()):
        self.log: dict[str, list] = {}
        self.broken = broken  # senders whose sends raise (a client gone)

    def _record(self, sender, entry):
        if sender in self.broken:
            raise ConnectionError(f"{sender} is gone")
        self.log.setdefault(sender, []).append(entry)

    def send_output(self, sender, output, wanted, fed):
        self._record(sender, ("output", output.response, output.final, fed))

    def heartbeat(self, sender):
        self._record(sender, ("beat",))

    def fail(self, sender, error):
        self._record(sender, ("fail", str(error)))

    def send(self, sender, keys, responses):
        self._record(sender, ("feed", list(zip(keys, responses, strict=True))))

    def end(self, sender, error):
        self._record(sender, ("end", error))


class Observer:
    def __init__(self):
        self.events: list = []

    def started(self, key):
        self.events.append(("started", key))

    def emitted(self, key, tokens):
        self.events.append(("emitted", key, tokens))

    def ended(self, key, outcome, started, finish_reason=None):
        self.events.append(("ended", key, outcome, started, finish_reason))


class EchoAssembler:
    """One output per delta: its text as the response, final with the delta's finish."""

    def on_delta(self, delta):
        return [ClientOutput(delta.text, delta.text, finish_reason=delta.finish_reason or "")]


class KV:
    def __init__(self):
        self.ended = 0

    def end(self):
        self.ended += 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def parts():
    transport, observer, cancelled, unwatched, clock = Transport(), Observer(), [], [], Clock()
    feeds = DecodeFeeds(transport, on_closed=lambda feed: None)
    streams = DecodeStreams(transport, observer, feeds, cancelled.append, unwatched.append, clock=clock)
    return streams, transport, observer, cancelled, unwatched, clock


def stream(key="r1", **more) -> DecodeStream:
    return DecodeStream(key, f"sender-{key}", EchoAssembler(), frozenset({"response"}), **more)


def delta(text, finish=None, tokens=1) -> Delta:
    return Delta(text, list(range(tokens)), finish)


def test_outputs_go_on_the_stream_and_the_last_ends_it(parts):
    streams, transport, observer, _, unwatched, _ = parts
    kv = KV()
    one = stream(kv=kv, given_first=True)
    streams.started(one)
    for piece in (delta("a"), delta("b", tokens=2), delta("c", "stop")):
        streams.send(one, piece)
    streams.send(one, delta("late"))  # after its end: nothing
    assert transport.log == {
        "sender-r1": [("output", "a", False, None), ("output", "b", False, None), ("output", "c", True, None)]
    }
    # prefill sampled its first token: decode counts 0, 2, 1
    assert observer.events == [
        ("started", "r1"),
        ("emitted", "r1", 0),
        ("emitted", "r1", 2),
        ("emitted", "r1", 1),
        ("ended", "r1", "finished", True, "stop"),
    ]
    assert kv.ended == 1 and unwatched == [one] and not one.open


def test_a_fed_stream_sends_all_but_its_last_through_the_feed_then_its_count(parts):
    streams, transport, _, _, _, _ = parts
    streams.feeds.open("feed", "feed-sender")
    fed = stream(feed="feed", feed_key="k")
    streams.send(fed, delta("a"))
    streams.send(fed, delta("b"))
    assert "sender-r1" not in transport.log  # both wait in the feed for the step's flush
    streams.send(fed, delta("c", "stop"))
    assert transport.log["feed-sender"] == [("feed", [("k", "a"), ("k", "b")])]  # flushed before the last
    assert transport.log["sender-r1"] == [("output", "c", True, 2)]
    assert streams.feeds.open("other", "other-sender")  # its stream left: the feed carries none
    streams.feeds.MAX_FEEDS = 2
    assert streams.feeds.open("third", "third-sender") and transport.log["feed-sender"][-1] == ("end", None)


def test_a_stream_whose_feed_is_not_held_at_its_first_output_is_never_fed(parts):
    streams, transport, _, _, _, _ = parts
    late = stream(feed="feed", feed_key="k")
    streams.send(late, delta("a"))
    streams.feeds.open("feed", "feed-sender")  # opens after: the stream stays on its own
    streams.send(late, delta("b", "stop"))
    assert transport.log == {"sender-r1": [("output", "a", False, None), ("output", "b", True, None)]}


def test_a_failed_send_stops_the_row_and_ends_the_stream_failed_once(parts):
    streams, transport, observer, cancelled, _, _ = parts
    transport.broken = {"sender-r1"}
    gone = stream()
    streams.send(gone, delta("a"))
    streams.send(gone, delta("b"))
    assert cancelled == ["r1"] and not gone.open
    assert observer.events == [("ended", "r1", "failed", False, None)]


@pytest.mark.parametrize(
    ("outcome", "error", "last"), [("cancelled", None, ("end", None)), ("failed", ValueError("x"), ("fail", "x"))]
)
def test_a_closed_stream_ends_once_with_its_last_response(parts, outcome, error, last):
    streams, transport, observer, _, _, _ = parts
    kv = KV()
    one = stream(kv=kv)
    streams.close(one, outcome, error)
    streams.close(one, "failed", RuntimeError("again"))
    assert transport.log == {"sender-r1": [last]} and kv.ended == 1
    assert observer.events == [("ended", "r1", outcome, False, None)]


def test_a_whole_answer_gets_a_heartbeat_after_its_quiet_time(parts):
    streams, transport, _, _, _, clock = parts

    class Quiet(EchoAssembler):
        def on_delta(self, delta):
            return [] if not delta.finish_reason else super().on_delta(delta)

    whole = DecodeStream("r1", "sender-r1", Quiet(), frozenset(), heartbeat_s=1.0, sent_at=0.0)
    streams.send(whole, delta("a"))
    clock.now = 1.5
    streams.send(whole, delta("b"))
    streams.send(whole, delta("c"))  # within a second of the beat: none
    assert transport.log == {"sender-r1": [("beat",)]}


def test_an_engine_s_callbacks_hand_each_event_over_in_order(parts):
    """The engine calls a stream's callbacks on its own thread: each hands its work over
    (decode's model: to its outbox thread), where the stream's sends happen."""
    streams, transport, observer, _, _, _ = parts
    posted = []
    one = stream()
    callbacks = streams.callbacks(one, lambda function, *args: posted.append((function, args)))
    callbacks.started()
    callbacks.emit(delta("a"))
    callbacks.emit(delta("b", "stop"))
    assert transport.log == {} and len(posted) == 3  # nothing ran on the engine's thread
    for function, args in posted:
        function(*args)
    assert transport.log == {"sender-r1": [("output", "a", False, None), ("output", "b", True, None)]}
    assert observer.events[0] == ("started", "r1")
    assert observer.events[-1] == ("ended", "r1", "finished", True, "stop")
