"""decode's feeds hold a caller's feed only while streams run through it: past MAX_FEEDS a new
feed takes the place of the one idle longest, and is refused only when every feed carries
streams (the red team's 64 idle feeds kept every front's feed out)."""

import pytest

from pdchat.core.errors import Unavailable
from pdchat.core.output.feeds import DecodeFeeds


class Recorder:
    """A FeedTransport that records what each sender got."""

    def __init__(self):
        self.sent: dict[str, list] = {}
        self.ended: dict[str, Exception | None] = {}

    def send(self, sender, keys, responses):
        self.sent.setdefault(sender, []).append(list(zip(keys, responses, strict=True)))

    def end(self, sender, error):
        assert sender not in self.ended, "a feed's request ends once"
        self.ended[sender] = error


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


@pytest.fixture
def feeds():
    transport, closed = Recorder(), []
    return DecodeFeeds(transport, on_closed=closed.append, clock=Clock()), transport, closed


def test_outputs_of_one_step_leave_as_one_response_per_feed(feeds):
    decode_feeds, transport, _ = feeds
    assert decode_feeds.open("a", "sender-a")
    assert decode_feeds.attach("a", "k1") and decode_feeds.attach("a", "k2")
    assert decode_feeds.add("a", "k1", "one") and decode_feeds.add("a", "k2", "two")
    assert not decode_feeds.add("b", "k3", "three")  # not open: the stream sends it itself
    decode_feeds.flush()
    decode_feeds.flush()  # nothing queued: nothing sent
    assert transport.sent == {"sender-a": [[("k1", "one"), ("k2", "two")]]}


def test_a_stream_is_attached_only_to_an_open_feed(feeds):
    decode_feeds, _, _ = feeds
    assert not decode_feeds.attach("missing", "k")
    decode_feeds.detach("missing", "k")  # a stream that never attached ends quietly


def test_past_the_most_a_new_feed_takes_the_place_of_the_one_idle_longest(feeds, monkeypatch):
    decode_feeds, transport, closed = feeds
    monkeypatch.setattr(DecodeFeeds, "MAX_FEEDS", 3)
    for name in ("busy", "idle-old", "idle-new"):
        assert decode_feeds.open(name, name)
    decode_feeds.attach("busy", "k")
    decode_feeds.attach("idle-old", "j")
    decode_feeds.detach("idle-old", "j")  # idle since after idle-new opened: idle-new is older now
    assert decode_feeds.open("front", "front")
    assert closed == ["idle-new"] and transport.ended == {"idle-new": None}
    assert decode_feeds.add("front", "x", "y") and decode_feeds.add("busy", "k", "z")


def test_a_feed_is_refused_only_when_every_feed_carries_streams(feeds, monkeypatch):
    decode_feeds, transport, closed = feeds
    monkeypatch.setattr(DecodeFeeds, "MAX_FEEDS", 2)
    for name in ("a", "b"):
        decode_feeds.open(name, name)
        decode_feeds.attach(name, f"key-{name}")
    assert not decode_feeds.open("c", "c")
    assert isinstance(transport.ended["c"], Unavailable) and "all of its 2 feeds" in str(transport.ended["c"])
    assert closed == [] and not decode_feeds.add("c", "k", "v")
    decode_feeds.detach("a", "key-a")  # a's last stream ended: its place can be taken
    assert decode_feeds.open("c", "c") and closed == ["a"]


def test_closing_a_feed_drops_its_pending_outputs_and_ends_its_request_once(feeds):
    decode_feeds, transport, closed = feeds
    decode_feeds.open("a", "sender-a")
    decode_feeds.attach("a", "k")
    decode_feeds.add("a", "k", "lost")
    decode_feeds.close("a")
    decode_feeds.close("a")
    decode_feeds.flush()
    assert transport.sent == {} and transport.ended == {"sender-a": None} and closed == ["a"]


def test_an_id_opened_again_replaces_the_feed_before(feeds):
    decode_feeds, transport, closed = feeds
    decode_feeds.open("a", "first")
    decode_feeds.open("a", "second")
    decode_feeds.attach("a", "k")
    decode_feeds.add("a", "k", "v")
    decode_feeds.flush()
    assert transport.ended == {"first": None} and transport.sent == {"second": [[("k", "v")]]}
    decode_feeds.close_all()
    assert transport.ended == {"first": None, "second": None} and closed == ["a", "a"]
