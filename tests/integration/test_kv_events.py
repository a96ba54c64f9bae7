"""KV events on a real tritonserver, read as a consumer would: a plain ZMQ SUB socket and
msgspec types in vLLM's field layout (written here, not imported from pdchat). A prefill
of a known prompt yields BlockStored events whose token ids are the prompt's full blocks
in order and whose hashes chain; a small pool and other prompts yield BlockRemoved; a
subscriber that joins late gets what it missed from the replay socket. pdchat's router,
reading them, stops sending a conversation to the server once it evicted its blocks.

The server is the session's small_pool_server (conftest): its prefill's 2 MiB pool holds
32 blocks of 16 tokens, so three ~220-token prompts evict."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import zmq

from pdchat.clients.affinity import prefix_keys
from pdchat.clients.chat import GrpcChat
from pdchat.clients.kv_index import KVEventSource
from pdchat.clients.router import PDRouter
from tests.integration.helpers import ask, blocking, chat_renders, metric, wait_for
from tests.kv_event_types import BlockRemoved, BlockStored, KVEventBatch

BLOCK_TOKENS = 16
TOPIC = b"kv-events"


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def subscribe(context, endpoint: str):
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the server
    return sub


def received(sub, quiet_s: float = 0.5) -> list[tuple[int, KVEventBatch]]:
    """Every message until none came for `quiet_s`: (seq, batch)."""
    messages = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC and len(seq) == 8
        messages.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return messages


def prompt(**fields) -> dict:
    system = f"Session {uuid.uuid4()}. " + "You answer briefly and precisely about lighthouses. " * 20
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Why are they tall?"}],
        "max_tokens": 2,
        "temperature": 0,
        "return_token_ids": True,
        **fields,
    }


def stored_blocks(messages) -> list[BlockStored]:
    return [event for _, batch in messages for event in batch.events if isinstance(event, BlockStored)]


def test_a_prefill_stores_the_prompts_full_blocks_in_order_with_chained_hashes(small_pool_server, context):
    sub = subscribe(context, small_pool_server.kv_events[0])
    client = GrpcChat(small_pool_server.grpc_url)
    result = ask(client, prompt())
    client.close()
    messages = received(sub)
    sub.close()
    seqs = [seq for seq, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "one seq per message, no gap"
    events = stored_blocks(messages)
    ids = result.prompt_token_ids
    full = len(ids) // BLOCK_TOKENS * BLOCK_TOKENS
    assert full >= 10 * BLOCK_TOKENS
    assert [token for event in events for token in event.token_ids] == ids[:full]
    hashes = [block for event in events for block in event.block_hashes]
    assert len(hashes) == full // BLOCK_TOKENS == len(set(hashes))
    assert events[0].parent_block_hash is None, "the first block has no parent (the root is no block)"
    parent = None
    for event in events:  # within an event each block's parent is the one before it
        assert event.parent_block_hash == parent, "block i's parent is block i-1's hash"
        assert len(event.token_ids) == len(event.block_hashes) * BLOCK_TOKENS
        assert (event.block_size, event.medium, event.lora_id, event.group_idx) == (BLOCK_TOKENS, "GPU", None, 0)
        parent = event.block_hashes[-1]
    assert all(batch.data_parallel_rank == 0 for _, batch in messages)


def test_eviction_from_a_small_pool_removes_blocks_it_stored(small_pool_server, context):
    sub = subscribe(context, small_pool_server.kv_events[0])
    client = GrpcChat(small_pool_server.grpc_url)
    for _ in range(3):
        ask(client, prompt())
    client.close()
    messages = received(sub)
    sub.close()
    removed = [
        block for _, batch in messages for e in batch.events if isinstance(e, BlockRemoved) for block in e.block_hashes
    ]
    stored = {block for event in stored_blocks(messages) for block in event.block_hashes}
    assert removed, "three ~220-token prompts do not fit a 32-block pool"
    assert any(block in stored for block in removed), "what was stored here is evicted"
    sent = messages[-1][0] + 1  # seqs count from 0 on this server
    assert wait_for(lambda: metric(small_pool_server, "pdchat_kv_events_published_total", model="prefill") == sent, 5)
    assert metric(small_pool_server, "pdchat_kv_events_dropped_total", model="prefill", reason="queue") == 0


def test_a_late_subscriber_gets_the_missed_messages_from_the_replay_socket(small_pool_server, context):
    client = GrpcChat(small_pool_server.grpc_url)
    result = ask(client, prompt())  # nobody listens
    client.close()
    time.sleep(0.3)  # published
    dealer = context.socket(zmq.DEALER)
    dealer.connect(small_pool_server.kv_events[1])
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert dealer.poll(5000), "the replay socket answers"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    dealer.close()
    assert [seq for seq, _ in replayed] == list(range(len(replayed))), "from seq 0, every message in order"
    ids = result.prompt_token_ids
    full = len(ids) // BLOCK_TOKENS * BLOCK_TOKENS
    tokens = [token for event in stored_blocks(replayed) for token in event.token_ids]
    assert tokens[-full:] == ids[:full], "the last prompt's blocks are the last stored"


def test_the_router_stops_sending_a_conversation_to_the_server_that_evicted_its_blocks(
    small_pool_server, decode_server
):
    """Prefill on the events server or the decode server, the router reading the former's
    events: a conversation's next turn scores there while its blocks are held; once other
    prompts evicted them, it scores 0 there and goes to the least loaded server."""
    home, other = small_pool_server.grpc_url, decode_server.grpc_url
    router = PDRouter([home, other], [other], kv_events={home: KVEventSource(*small_pool_server.kv_events)})
    try:
        first = prompt()
        [answer] = list(blocking(router.chat(first)))  # a new router's first pick: the first prefill server
        second = {
            **first,
            "messages": [
                *first["messages"],
                {"role": "assistant", "content": answer.response["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And how far does their light reach?"},
            ],
        }
        keys = prefix_keys(second)
        assert wait_for(lambda: router.affinity.scores(keys, [home, other]) == {home: 2, other: 0}, 5), (
            "held there: the next turn would go back"
        )
        client = GrpcChat(home)
        for _ in range(3):  # other conversations fill the 32-block pool: the first one's blocks go
            ask(client, prompt())
        client.close()
        assert wait_for(lambda: router.affinity.scores(keys, [home, other])[home] == 0, 5), "evicted: no affinity"
        renders = {url: chat_renders(server) for url, server in ((home, small_pool_server), (other, decode_server))}
        [_] = list(blocking(router.chat(second)))
        assert chat_renders(decode_server) == renders[other] + 1, "prefilled on the least loaded server"
        assert chat_renders(small_pool_server) == renders[home]
        stats = router.health()["kv_events"][home]
        assert stats["messages"] > 0 and stats["resets"] == 0 and stats["skipped_blocks"] == 0
    finally:
        router.close()
