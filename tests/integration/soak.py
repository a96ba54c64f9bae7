"""The soak both test_soak (one server) and test_pd (the P/D pair) run: hundreds of streams
at concurrency 16, then streams abandoned mid-way; nothing may fail, and nothing may stay
behind: decode work, shared-memory regions, memory."""

from __future__ import annotations

from pathlib import Path

from benchmarks import load
from pdchat.clients.chat import GrpcChat, chat_inputs
from tests.integration.helpers import metric, wait_for

CONCURRENCY = 16
REQUESTS = 200
ABANDONED = 50
WARM_UP = 32
RSS_GROWTH = 1.10


def body(index: int, max_tokens: int = 8) -> dict:
    """Short chats that differ per request, so no two prompts are the same length."""
    return {
        "messages": [{"role": "user", "content": f"Request {index}: " + "tell me more " * (index % 7)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def long_body(index: int) -> dict:
    return {**body(index, max_tokens=32), "ignore_eos": True}


def server_memory(server) -> dict[int, int]:
    """RSS by pid of tritonserver and its stubs, without the stubs' grammar workers: those start
    in the background at load (so a snapshot may catch one half-imported), and their memory
    is bounded on its own (grammar_worker_mb; tests/integration/test_grammar_bounds.py)."""
    return {pid: rss for pid, rss in server.memory().items() if not _is_grammar_worker(pid)}


def _is_grammar_worker(pid: int) -> bool:
    try:
        return b"pdchat.core.generation.grammar_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def soak(send, servers, decode_server, *, abandon_cancels: bool) -> None:
    """Warm up, then REQUESTS streams and ABANDONED abandoned ones at CONCURRENCY; check
    errors, decode work, shm regions and RSS of every process of `servers`."""
    warm = load.run(send, body, WARM_UP, CONCURRENCY)
    assert load.first_errors(warm) == []
    rss = {id(s): server_memory(s) for s in servers}
    regions = {id(s): len(s.leaked_shm()) for s in servers}

    outcomes = load.run(send, body, REQUESTS, CONCURRENCY)
    assert len(outcomes) == REQUESTS and load.first_errors(outcomes) == []

    cancelled = metric(decode_server, "pdchat_decode_requests_total", outcome="cancelled")
    abandoned = load.run(send, long_body, ABANDONED, CONCURRENCY, abandon_after=2)
    assert load.first_errors(abandoned) == [] and all(o.abandoned for o in abandoned)
    # (A bound for the check: where cancellation cannot reach decode, the streams run to their end.)
    assert wait_for(lambda: metric(decode_server, "pdchat_decode_active") == 0, timeout=180)
    if abandon_cancels:
        assert metric(decode_server, "pdchat_decode_requests_total", outcome="cancelled") > cancelled

    after = load.run(send, body, CONCURRENCY, CONCURRENCY)  # still serving, and nothing was lost
    assert load.first_errors(after) == []
    for server in servers:
        assert len(server.leaked_shm()) <= regions[id(server)], "python-backend shm regions grew"
        # The server as a whole (tritonserver and its stubs): a 50 MiB process moving by a few
        # MiB of allocator pools is not a leak; a leak shows in the total.
        before, now = rss[id(server)], server_memory(server)
        assert sum(now.values()) <= sum(before.values()) * RSS_GROWTH, (
            f"the {server.role} server grew from {sum(before.values()) >> 20} to {sum(now.values()) >> 20} MiB "
            f"({', '.join(f'{pid}: {before[pid] >> 20} -> {now.get(pid, 0) >> 20}' for pid in before)})"
        )


def kv_engine(stack) -> str:
    """The prefill server's shm engine id (in every KV file name it writes), from one handoff."""
    client = GrpcChat(stack.prefill.grpc_url)
    try:
        [handed] = client.stream(chat_inputs(body(0), kv_transfer_params={"do_remote_decode": True}))
    finally:
        client.close()
    return handed.kv_transfer_params["kv_handle"]["location"]["name"].split("_")[2]
