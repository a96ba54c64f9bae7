"""Who prefills a plain prompt on one server with local_prefill_when_idle on (the session's
`server`): decode itself while it holds no sequence, prefill while it is busy. The answer
is the same either way, token for token."""

from __future__ import annotations

import threading

from pdchat.clients.chat import GrpcChat, chat_inputs, collect
from tests.integration.helpers import ask, computed_since, conversation, metric, prompt_tokens_computed, wait_for


def decoding(server) -> float:
    return metric(server, "pdchat_decode_active")


def test_an_idle_decode_prefills_itself_and_a_busy_one_leaves_it_to_prefill(server):
    body = conversation(max_tokens=10)
    client = GrpcChat(server.grpc_url)
    assert wait_for(lambda: decoding(server) == 0, 10), "decode still busy with an earlier test's request"
    before = prompt_tokens_computed(server)
    idle = ask(client, body)
    prompt = len(idle.prompt_token_ids)
    assert computed_since(server, before, prompt) == {"prefill": 0, "decode": prompt}

    started, stop = threading.Event(), threading.Event()

    def keep_decode_busy() -> None:
        """One long answer, left (its request cancelled) once the test is done: however fast
        the host decodes, decode stays busy for as long as the test looks."""
        own = GrpcChat(server.grpc_url)
        long = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 8000, "ignore_eos": True}
        try:
            for _ in own.stream(chat_inputs({**long, "stream": True})):
                started.set()
                if stop.is_set():
                    break
        finally:
            own.close()

    busy_thread = threading.Thread(target=keep_decode_busy)
    busy_thread.start()
    try:
        assert started.wait(30) and wait_for(lambda: decoding(server) >= 1, 10)
        wait_for(lambda: prompt_tokens_computed(server)["decode"] > before["decode"] + prompt, 5)  # its prompt
        before = prompt_tokens_computed(server)
        busy = ask(client, {**body, "cache_salt": "busy"})  # no block shared with the idle one's prompt
        assert computed_since(server, before, prompt) == {"prefill": prompt, "decode": 0}
    finally:
        stop.set()
        busy_thread.join(120)
        client.close()
    assert wait_for(lambda: decoding(server) == 0, 10), "the long answer left behind was not cancelled"
    assert busy.output_token_ids == idle.output_token_ids
    assert collect(GrpcChat(server.grpc_url).stream(chat_inputs(body))).output_token_ids == idle.output_token_ids
