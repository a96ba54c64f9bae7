"""The router's server pools: a server that does not answer gets no requests, and no
prefill work starts while no decode server could finish it."""

import pytest

from pdchat.clients.chat import ChatError
from pdchat.clients.router import BackendPool, PDRouter
from pdchat.core.errors import ErrorCode
from pdchat.launcher import free_port


def unreachable() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def test_a_pool_of_unreachable_servers_refuses_with_unavailable():
    pool = BackendPool([unreachable(), unreachable()], "decode", reprobe_s=0.0)
    pool.mark_failed(pool.backends[0])
    pool.mark_failed(pool.backends[1])
    with pytest.raises(ChatError) as info, pool.pick():
        pass
    assert info.value.code is ErrorCode.UNAVAILABLE and "no decode server is ready" in str(info.value)


def test_a_failed_server_is_skipped_while_another_is_healthy():
    pool = BackendPool([unreachable(), unreachable()], "decode", reprobe_s=3600)
    pool.mark_failed(pool.backends[0])  # probed: down, and not probed again for an hour
    picks = set()
    for _ in range(4):
        with pool.pick() as backend:
            picks.add(backend.url)
    assert picks == {pool.backends[1].url}


def test_no_prefill_leg_starts_while_no_decode_server_is_ready():
    router = PDRouter([unreachable()], [unreachable()])
    router.decode.mark_failed(router.decode.backends[0])
    with pytest.raises(ChatError) as info:
        list(router.chat({"messages": [{"role": "user", "content": "hi"}]}))
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert router.stats.prefill_fallbacks == 0 and router.prefill.backends[0].checked_at == 0.0, "prefill was tried"
