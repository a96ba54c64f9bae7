"""KV events (pdchat.core.kv_events): the encoding, decoded with consumer-side types in
vLLM's field layout; the bounded queue, coalescing and replay buffer; the pool's hunk
(stored with a parent chain, removed on eviction, cleared); the publisher over real ZMQ
sockets: the multipart frames, the replay protocol, a slow subscriber's loss counted."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from pdchat.core import kv_events
from pdchat.core.generation.paged import BlockPool, Sequence, block_hash, root_hash
from pdchat.core.kv_events import (
    END_SEQ,
    BlockEvents,
    Cleared,
    KVEventPublisher,
    Removed,
    ReplayBuffer,
    Stored,
    coalesce,
    decode,
    encode,
    instance_endpoint,
)
from pdchat.core.settings import kv_events_options
from pdchat.launcher import free_port
from tests.kv_event_types import ARRAY, BlockRemoved, BlockStored, KVEventBatch


class OldBlockStored(ARRAY.KVCacheEvent, tag="BlockStored"):
    """The first vLLM layout (five fields): a consumer that old still parses ours."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
TOP = (1 << 64) - 1  # our keys are 8-byte unsigned ints: msgpack's uint64


def test_the_array_layout_is_vllms_positional_structs_tag_first():
    events = [Stored([TOP, 7], None, list(range(32)), [None, None]), Removed([5]), Cleared()]
    payload = encode(events, block_size=16, rank=2, layout="array", ts=12.5)
    assert msgspec.msgpack.decode(payload) == [
        12.5,
        [
            ["BlockStored", [TOP, 7], None, list(range(32)), 16, None, "GPU", None, None, 0, None, None],
            ["BlockRemoved", [5], "GPU", 0],
            ["AllBlocksCleared"],
        ],
        2,
    ]
    batch = msgspec.msgpack.Decoder(ARRAY.KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 2
    assert batch.events == [
        ARRAY.BlockStored([TOP, 7], None, list(range(32)), 16, None, "GPU", None, group_idx=0),
        ARRAY.BlockRemoved([5], "GPU", group_idx=0),
        ARRAY.AllBlocksCleared(),
    ]
    old = msgspec.msgpack.Decoder(list[OldBlockStored]).decode(
        msgspec.msgpack.encode(msgspec.msgpack.decode(payload)[1][:1])
    )
    assert old == [OldBlockStored([TOP, 7], None, list(range(32)), 16, None)]


def test_the_map_layout_tags_each_event_under_type_in_a_positional_batch():
    payload = encode([Stored([3], 9, [1, 2], [None]), Removed([3])], block_size=2, rank=0, ts=1.0)  # the default
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (1.0, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [3],
        "parent_block_hash": 9,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0}


def test_coalesce_joins_a_chain_and_consecutive_removals_keeping_the_order():
    raw = [
        ("stored", 1, None, [1, 1], ("salt",)),
        ("stored", 2, 1, [2, 2], None),  # child of 1: joins
        ("stored", 3, None, [3, 3], None),  # another sequence's first block
        ("stored", 4, 2, [4, 4], None),  # child of 2, but not of the last one stored: apart
        ("removed", 1),
        ("removed", 3),
        ("cleared",),
        ("removed", 4),
    ]
    assert coalesce(raw) == [
        Stored([1, 2], None, [1, 1, 2, 2], [("salt",), None]),
        Stored([3], None, [3, 3], [None]),
        Stored([4], 2, [4, 4], [None]),
        Removed([1, 3]),
        Cleared(),
        Removed([4]),
    ]


def test_the_queue_is_bounded_and_counts_what_it_drops():
    sink = BlockEvents(capacity=2)
    sink.stored(1, None, [0])
    sink.removed(1)
    sink.cleared()
    assert sink.dropped == 1 and len(sink) == 2
    assert sink.drain() == [("stored", 1, None, [0], None), ("removed", 1)]
    sink.cleared()
    assert sink.drain() == [("cleared",)]


def test_the_replay_buffer_keeps_the_last_messages_and_answers_from_a_seq_on():
    buffer = ReplayBuffer(3)
    for seq in range(5):
        buffer.append(seq, b"%d" % seq)
    assert buffer.since(0) == [(2, b"2"), (3, b"3"), (4, b"4")]
    assert buffer.since(4) == [(4, b"4")]
    assert buffer.since(5) == []


def test_each_instance_gets_its_own_endpoint():
    assert instance_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert instance_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert instance_endpoint("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert instance_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_1"
    assert instance_endpoint(None, 3) is None


def test_settings_are_off_by_default_and_per_role():
    assert kv_events_options("prefill", {}, {}) is None
    environ = {"PDCHAT_PREFILL_KV_EVENTS_ENDPOINT": "tcp://*:5557"}
    options = kv_events_options("prefill", {}, environ)
    assert (options.endpoint, options.replay_endpoint, options.topic, options.buffer_steps, options.layout) == (
        "tcp://*:5557",
        None,
        "kv-events",
        10_000,
        "map",
    )
    assert kv_events_options("decode", {}, environ) is None


def pool(blocks: int = 5, block_tokens: int = 2) -> BlockPool:
    return BlockPool(
        layers=1, kv_heads=1, head_dim=2, block_tokens=block_tokens, blocks=blocks, dtype=torch.float32, device="cpu"
    )


def test_the_pool_tells_keyed_blocks_with_their_parent_evictions_and_clears():
    kv = pool(blocks=5)  # 4 usable blocks of 2 tokens
    kv.events = sink = BlockEvents()
    root = root_hash("m", None)
    first = Sequence(kv, root)
    first.extend([1, 2, 3, 4, 5])
    first.written()
    one = block_hash(root, [1, 2])
    two = block_hash(one, [3, 4])
    assert sink.drain() == [("stored", one, None, [1, 2], None), ("stored", two, one, [3, 4], None)]
    first.release()  # both stay cached, a third block freed
    second = Sequence(kv, root_hash("m", "other tenant"))
    second.extend([9, 9, 9, 9, 9, 9])  # 3 blocks: the free two and a cached one, the chain's tail
    assert sink.drain() == [("removed", two)]
    second.written()
    assert [item[0] for item in sink.drain()] == ["stored"] * 3
    kv.clear_cache()
    assert sink.drain() == [("cleared",)]


def test_a_pool_without_a_sink_or_cache_says_nothing():
    kv = pool()
    sequence = Sequence(kv, 0)
    sequence.extend([1, 2, 3])
    sequence.written()  # no sink: nothing to tell
    off = BlockPool(
        layers=1,
        kv_heads=1,
        head_dim=2,
        block_tokens=2,
        blocks=5,
        dtype=torch.float32,
        device="cpu",
        prefix_caching=False,
    )
    off.events = sink = BlockEvents()
    sequence = Sequence(off, 0)
    sequence.extend([1, 2, 3])
    sequence.written()
    assert len(sink) == 0


def wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_the_publisher_sends_topic_seq_payload_and_replays_what_a_late_subscriber_missed(tmp_path, context):
    endpoint, replay_endpoint = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    sink = BlockEvents()
    reports = []
    publisher = KVEventPublisher(
        sink,
        endpoint=endpoint,
        replay_endpoint=replay_endpoint,
        block_size=2,
        topic="kv-events",
        buffer_steps=100,
        on_stats=reports.append,
    )
    try:
        sink.stored(11, None, [1, 2])  # before anyone subscribes: seq 0 reaches no one
        wait(lambda: publisher.published == 1)
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        sink.stored(12, 11, [3, 4])
        sink.removed(11)
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events" and int.from_bytes(seq, "big") >= 1
        # The late subscriber asks for everything from seq 0.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            empty, seq_bytes, body = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert body == b""
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), DECODER.decode(body)))
        assert replayed[0][0] == 0
        assert replayed[0][1].events == [BlockStored([11], None, [1, 2], 2, None, "GPU", None, group_idx=0)]
        events = [event for _, batch in replayed for event in batch.events]
        assert events[1:] == [
            BlockStored([12], 11, [3, 4], 2, None, "GPU", None, group_idx=0),
            BlockRemoved([11], "GPU", group_idx=0),
        ]
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    finally:
        publisher.close()
    assert reports and reports[-1].published == publisher.published


def test_a_slow_subscriber_loses_messages_counted_and_kept_for_replay(tmp_path, context, monkeypatch):
    monkeypatch.setattr(kv_events, "SOCKET_HWM", 1)
    endpoint = f"ipc://{tmp_path}/events"
    sink = BlockEvents()
    publisher = KVEventPublisher(sink, endpoint=endpoint, block_size=16, buffer_steps=1000)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.2)
    big = [70_000] * 100_000  # about 500 KB a message: the socket buffers fill in a few
    try:
        for key in range(40):
            sink.stored(key, None, big)
            wait(lambda: len(sink) == 0)
        wait(lambda: publisher.published + publisher.dropped_messages == 40)
    finally:
        publisher.close()
    stats = publisher.stats()
    assert stats.dropped_messages > 0 and stats.dropped_events == 0
    assert [seq for seq, _ in publisher._replay_buffer.since(0)] == list(range(40))  # noqa: SLF001


def test_an_endpoint_that_cannot_be_bound_fails_the_constructor():
    endpoint = f"tcp://*:{free_port()}"
    first = KVEventPublisher(BlockEvents(), endpoint=endpoint, block_size=16)
    try:
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(BlockEvents(), endpoint=endpoint, block_size=16)  # the port is taken
    finally:
        first.close()


def salted_events(layout: str = "map") -> bytes:
    """The payload of a salted prompt's two blocks, then an unsalted one's block."""
    kv = pool(blocks=5)
    kv.events = sink = BlockEvents()
    for salt, prompt in (("tenant-a", [1, 2, 3, 4]), (None, [5, 6])):
        sequence = Sequence(kv, root_hash("m", salt), salt)
        sequence.extend(prompt)
        sequence.written()
    return encode(coalesce(sink.drain()), block_size=2, rank=0, layout=layout, ts=1.0)


def test_a_sequence_s_first_block_carries_its_cache_salt_as_vllm_s_do():
    [salted, plain] = DECODER.decode(salted_events()).events
    assert salted.extra_keys == [("tenant-a",), None] and salted.token_ids == [1, 2, 3, 4]
    assert plain.extra_keys is None  # omitted where no block has extra keys
    [again, _] = decode(salted_events(), block_size=2)
    assert again.extra_keys == [("tenant-a",), None]


def vllm_python() -> Path | None:
    """The Python of a venv with vLLM installed ($PDCHAT_VLLM_VENV, else the checkout's
    .venv-vllm), or None."""
    venv = Path(os.environ.get("PDCHAT_VLLM_VENV") or Path(__file__).resolve().parents[2] / ".venv-vllm")
    python = venv / "bin" / "python"
    return python if python.exists() else None


@pytest.mark.skipif(vllm_python() is None, reason="no venv with vLLM ($PDCHAT_VLLM_VENV or .venv-vllm)")
def test_vllm_s_own_types_decode_the_default_layout_salt_included():
    """vLLM 0.32's KVEventBatch refused every message of the array layout ("Expected
    object, got array"); the default layout is the one it reads."""
    script = (
        "import sys, json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "batch = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=KVEventBatch)\n"
        "print(json.dumps([[type(e).__name__, e.block_hashes, e.parent_block_hash, e.token_ids, e.extra_keys]"
        " for e in batch.events]))\n"
    )
    run = subprocess.run(
        [str(vllm_python()), "-c", script], input=salted_events(), capture_output=True, timeout=120, check=True
    )
    [salted, plain] = json.loads(run.stdout.splitlines()[-1])
    assert salted[0] == "BlockStored" and salted[3] == [1, 2, 3, 4] and salted[4] == [["tenant-a"], None]
    assert salted[2] is None and plain[2] is None and plain[4] is None  # each starts its sequence; no salt
    refused = subprocess.run(
        [str(vllm_python()), "-c", script], input=salted_events("array"), capture_output=True, timeout=120
    )
    assert refused.returncode != 0 and b"Expected `object`, got `array`" in refused.stderr
