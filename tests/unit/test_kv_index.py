"""The router's view of a prefill server's blocks from its KV events (clients/kv_index.py):
blocks keyed by content whatever the server's root, held only while every block before
them is; prefix affinity drops a conversation whose blocks were evicted; the subscriber
replays what it missed and starts over when no replay has it or the server restarted."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import zmq
import zmq.auth

from pdchat.clients.affinity import PrefixAffinity, prefix_keys
from pdchat.clients.kv_index import BlockIndex, KVEventSource, KVEventSubscriber, parse_sources
from pdchat.core.kv_events import END_SEQ, BlockEvents, Cleared, KVEventPublisher, Removed, Stored, decode, encode
from pdchat.launcher import free_port
from tests.unit.test_affinity import turn

SIZE = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def stored(keys: list[int], parent: int | None, token_ids: list[int]) -> Stored:
    return Stored(list(keys), parent, list(token_ids), [None] * len(keys))


def test_decode_reads_both_layouts_and_refuses_another_block_size():
    events = [stored([1, 2], None, tokens(2 * SIZE)), Removed([1]), Cleared()]
    for layout in ("array", "map"):
        assert decode(encode(events, SIZE, 0, layout), SIZE) == events
    with pytest.raises(ValueError, match="blocks of 4 tokens, expected 16"):
        decode(encode(events, SIZE, 0), 16)
    with pytest.raises(ValueError, match="not a KV events batch"):
        decode(b"\x01", SIZE)


def test_a_prompt_is_held_while_every_block_it_starts_with_is():
    index = BlockIndex(SIZE)
    prompt = tokens(3 * SIZE + 2)  # three full blocks
    assert index.prompt_key(tokens(SIZE - 1)) is None, "no full block"
    index.apply([stored([101, 102], None, prompt[: 2 * SIZE])])
    assert not index.holds(index.prompt_key(prompt)), "its third block is not stored yet"
    index.apply([stored([103], 102, prompt[2 * SIZE : 3 * SIZE])])  # the next turn's blocks chain on
    assert index.holds(index.prompt_key(prompt)) and len(index) == 3
    index.apply([Removed([101])])  # the first block evicted: nothing after it is reusable
    assert not index.holds(index.prompt_key(prompt))
    assert not index.holds(index.prompt_key(prompt[: 2 * SIZE]))
    index.apply([Cleared()])
    assert len(index) == 0


def test_keys_do_not_depend_on_the_servers_root_and_lost_parents_are_skipped():
    index = BlockIndex(SIZE)
    prompt = tokens(2 * SIZE)
    # Two roots (say two salts) store the same tokens under other server keys: one content key, held twice.
    index.apply([stored([1, 2], None, prompt), stored([7, 8], None, prompt)])
    index.apply([Removed([1, 2])])
    assert index.holds(index.prompt_key(prompt)), "the other root's blocks still hold these tokens"
    index.apply([stored([9], 555, tokens(SIZE, 100))])  # its parent's event never came
    assert index.stats.skipped_blocks == 1 and len(index) == 2


def test_affinity_drops_a_conversation_whose_blocks_its_server_evicted():
    index = BlockIndex(SIZE)
    affinity = PrefixAffinity(indexes={"a": index})
    first, second = prefix_keys(turn(1)), prefix_keys(turn(2))
    assert affinity.choose(first, {"a": 0, "b": 0}) == "a"
    prompt = tokens(3 * SIZE)
    affinity.bind("a", first[-1], index.prompt_key(prompt))
    index.apply([stored([11, 12, 13], None, prompt)])  # prefill stored them
    assert affinity.scores(second, ["a", "b"]) == {"a": len(first), "b": 0}
    assert affinity.choose(second, {"a": 1, "b": 0}) == "a", "held: the conversation's home, a little busier"
    longer = prompt + tokens(2 * SIZE, 50)
    affinity.bind("a", second[-1], index.prompt_key(longer))
    index.apply([stored([14, 15], 13, longer[3 * SIZE :])])
    third = prefix_keys(turn(3))
    assert affinity.scores(third, ["a"]) == {"a": len(second)}
    index.apply([Removed([15])])  # the last turn's tail evicted: the turn before still holds
    assert affinity.scores(third, ["a"]) == {"a": len(first)}
    index.apply([Removed([11])])  # evicted from its first block: no affinity left
    assert affinity.scores(third, ["a", "b"]) == {"a": 0, "b": 0}
    assert affinity.choose(third, {"a": 1, "b": 0}) == "b", "the least loaded"


def test_a_server_without_events_keeps_the_message_table():
    affinity = PrefixAffinity(indexes={"a": BlockIndex(SIZE)})
    keys = prefix_keys(turn(1))
    affinity.choose(keys, {"b": 0})
    affinity.bind("b", keys[-1], 12345)  # no index for b: nothing to check it against
    assert affinity.scores(prefix_keys(turn(2)), ["b"]) == {"b": len(keys)}


def test_sources_parse_like_vllm_routers_flags():
    assert parse_sources(["p:1=tcp://h:5557"], ["p:1=tcp://h:5558"]) == {
        "p:1": KVEventSource("tcp://h:5557", "tcp://h:5558")
    }
    for sources, replays, message in (
        (["p:1"], [], "SERVER=ENDPOINT"),
        (["p:1=tcp://h:1,tcp://h:2"], [], "one endpoint per server"),
        (["p:1=tcp://h:1", "p:1=tcp://h:2"], [], "given twice"),
        (["p:1=tcp://h:1"], ["p:2=tcp://h:2"], "has no --kv-event-source"),
        # Malformed endpoints killed the subscriber thread once the router ran, found by the red team.
        (["p:1=h:5557"], [], "--kv-event-source 'p:1=h:5557': not a ZMQ endpoint"),
        (["p:1=tcp://h:port"], [], "not a ZMQ endpoint"),
        (["p:1=tcp://h:1"], ["p:1=h:5558"], "--kv-event-replay-source 'p:1=h:5558': not a ZMQ endpoint"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_sources(sources, replays)


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_late_subscriber_replays_what_the_publisher_sent_before_it_joined():
    pub, replay = free_port(), free_port()
    sink = BlockEvents()
    publisher = KVEventPublisher(sink, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}", block_size=SIZE)
    prompt = tokens(2 * SIZE)
    sink.stored(1, None, prompt[:SIZE])
    time.sleep(0.2)  # published to nobody
    index = BlockIndex(SIZE)
    subscriber = KVEventSubscriber(index, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        time.sleep(0.3)  # subscribed
        sink.stored(2, 1, prompt[SIZE:])
        assert wait_for(lambda: index.holds(index.prompt_key(prompt)))
        assert index.stats.replayed == 1 and index.stats.resets == 0
    finally:
        subscriber.close()
        publisher.close()


def curve_dirs(tmp_path):
    """A publisher's CURVE directory authorizing one subscriber, that subscriber's, and an
    unauthorized one's (zmq.auth certificates)."""
    made = {}
    for name in ("publisher", "router", "stranger"):
        made[name] = tmp_path / name
        made[name].mkdir()
    zmq.auth.create_certificates(made["publisher"], "server")
    for name in ("router", "stranger"):
        zmq.auth.create_certificates(made[name], "client")
        shutil.copy(made["publisher"] / "server.key", made[name])
    (made["publisher"] / "authorized").mkdir()
    shutil.copy(made["router"] / "client.key", made["publisher"] / "authorized")
    return made


def test_with_curve_only_an_authorized_subscriber_reads_the_events(tmp_path, caplog):
    """Events carry every prompt's token ids: with kv_events_curve_dir they are encrypted and
    only subscribers whose keys the publisher authorized read them; bound to all interfaces
    without it, the publisher says so."""
    dirs, pub, replay = curve_dirs(tmp_path), free_port(), free_port()
    sink = BlockEvents()
    publisher = KVEventPublisher(
        sink,
        endpoint=f"tcp://*:{pub}",
        replay_endpoint=f"tcp://*:{replay}",
        block_size=SIZE,
        curve_dir=str(dirs["publisher"]),
    )
    assert "in plaintext" not in caplog.text
    readers = {
        name: (BlockIndex(SIZE), curve)
        for name, curve in (("router", str(dirs["router"])), ("stranger", str(dirs["stranger"])), ("plain", None))
    }
    subscribers = [
        KVEventSubscriber(index, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", curve_dir=curve)
        for index, curve in readers.values()
    ]
    prompt = tokens(2 * SIZE)
    try:
        time.sleep(0.5)  # subscribed (or refused)
        sink.stored(1, None, prompt[:SIZE])
        sink.stored(2, 1, prompt[SIZE:])
        router = readers["router"][0]
        assert wait_for(lambda: router.holds(router.prompt_key(prompt)))
        time.sleep(0.3)
        for name in ("stranger", "plain"):
            index = readers[name][0]
            assert not index.holds(index.prompt_key(prompt)), f"{name} read the events"
    finally:
        for subscriber in subscribers:
            subscriber.close()
        publisher.close()
    plain = KVEventPublisher(BlockEvents(), endpoint=f"tcp://*:{free_port()}", block_size=SIZE)
    plain.close()
    assert "in plaintext" in caplog.text


def test_a_loopback_endpoint_is_bound_for_this_host_alone():
    port = free_port()
    sink = BlockEvents()
    publisher = KVEventPublisher(sink, endpoint=f"tcp://127.0.0.1:{port}", block_size=SIZE)  # bound, not connected
    index = BlockIndex(SIZE)
    subscriber = KVEventSubscriber(index, f"tcp://127.0.0.1:{port}")
    prompt = tokens(SIZE + 1)
    try:
        time.sleep(0.3)
        sink.stored(1, None, prompt[:SIZE])
        assert wait_for(lambda: index.holds(index.prompt_key(prompt)))
    finally:
        subscriber.close()
        publisher.close()


class FakeServer:
    """A PUB socket sending chosen seqs and a ROUTER answering replays from what it sent."""

    def __init__(self, context: zmq.Context):
        self.port, self.replay_port = free_port(), free_port()
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.sent: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def send(self, seq: int, events: list, live: bool = True) -> None:
        payload = encode(events, SIZE, 0)
        self.sent[seq] = payload
        if live:
            self.pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))

    def _answer(self) -> None:
        while not self._stop.is_set():
            if self.router.poll(50):
                identity, _, start = self.router.recv_multipart()
                for seq in sorted(s for s in self.sent if s >= int.from_bytes(start, "big")):
                    self.router.send_multipart((identity, b"", seq.to_bytes(8, "big"), self.sent[seq]))
                self.router.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def fake_server():
    context = zmq.Context()
    server = FakeServer(context)
    yield server
    server.close()
    context.destroy(linger=0)


def test_a_gap_is_filled_from_the_replay_socket_in_order(fake_server):
    index = BlockIndex(SIZE)
    resets = []
    subscriber = KVEventSubscriber(
        index,
        f"tcp://127.0.0.1:{fake_server.port}",
        f"tcp://127.0.0.1:{fake_server.replay_port}",
        on_reset=lambda: resets.append(1),
    )
    prompt = tokens(3 * SIZE)
    try:
        time.sleep(0.3)
        fake_server.send(0, [stored([1], None, prompt[:SIZE])])
        fake_server.send(1, [stored([2], 1, prompt[SIZE : 2 * SIZE])], live=False)  # lost on the way
        fake_server.send(2, [stored([3], 2, prompt[2 * SIZE :])])  # applies only after 1 is replayed
        assert wait_for(lambda: index.holds(index.prompt_key(prompt)))
        assert (index.stats.messages, index.stats.replayed, resets) == (3, 1, [])
        fake_server.sent.clear()
        fake_server.send(0, [stored([4], None, tokens(SIZE, 99))])  # restarted: seq from 0 again
        assert wait_for(lambda: index.stats.resets == 1)
        assert resets == [1] and not index.holds(index.prompt_key(prompt)) and len(index) == 1
    finally:
        subscriber.close()


def test_a_gap_no_replay_can_fill_starts_the_index_over(fake_server):
    index = BlockIndex(SIZE)
    subscriber = KVEventSubscriber(index, f"tcp://127.0.0.1:{fake_server.port}")  # no replay endpoint
    try:
        time.sleep(0.3)
        fake_server.send(0, [stored([1], None, tokens(SIZE))])
        assert wait_for(lambda: len(index) == 1)
        fake_server.send(5, [stored([6], None, tokens(SIZE, 40))])
        assert wait_for(lambda: index.stats.resets == 1)
        assert len(index) == 1 and not index.holds(index.prompt_key(tokens(SIZE)))
    finally:
        subscriber.close()
