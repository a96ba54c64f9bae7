"""P/D across hosts: prefill and decode servers in two network namespaces (hosts that
reach each other only over IP), KV over NIXL with UCX on TCP, the router in this one.
Answers equal monolithic; a cut link makes decode recompute, never fail."""

from __future__ import annotations

import pytest

from pdchat.clients.chat import GrpcChat, chat_inputs, collect
from pdchat.clients.router import PDRouter
from pdchat.launcher import TritonServer
from tests.conversations import PARITY_CASES
from tests.integration import netns
from tests.integration.conftest import TEST_POOLS, at_once
from tests.integration.helpers import blocking, metric

pytestmark = [
    pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 for network namespaces"),
    pytest.mark.faults,
]
BODY = {"max_tokens": 10, "temperature": 0, **PARITY_CASES["multi_turn"]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_dir):
    with netns.Hosts(2) as (host_a, host_b):
        # UCX would use shared memory between processes of one machine: TCP, as across hosts.
        env = {
            "PDCHAT_MODEL": "tiny",
            "PDCHAT_HANDOFF_KEY": "cross-host-key-0123456789abcdef",
            "PDCHAT_KV_CONNECTOR": "nixl",
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
            "PDCHAT_KV_PULL_TIMEOUT_S": "5",
            **TEST_POOLS,
        }
        logs = tmp_path_factory.mktemp("cross-host-logs")
        servers = [
            TritonServer(role=role, env=env, host=host.address, netns=host.name, log_path=logs / f"{role}.log")
            for role, host in (("prefill", host_a), ("decode", host_b))
        ]
        try:
            at_once([server.start for server in servers])
            yield (*servers, host_a)
        finally:  # both at once, and before their namespaces go

            def stop(server: TritonServer) -> None:
                server.stop()
                assert server.leaked_shm() == [], f"the {server.role} server left shared-memory regions behind"

            at_once([lambda s=server: stop(s) for server in servers if server.process is not None])


def test_pd_across_hosts_over_nixl_equals_monolithic(pair, server):
    prefill, decode, _ = pair
    expected = collect(GrpcChat(server.grpc_url).stream(chat_inputs(BODY))).output_token_ids
    pulled = metric(decode, "pdchat_kv_pulls_total", outcome="pulled")
    router = PDRouter([prefill.grpc_url], [decode.grpc_url])
    assert collect(blocking(router.chat(BODY))).output_token_ids == expected
    assert router.stats.disaggregated == 1
    assert metric(decode, "pdchat_kv_pulls_total", outcome="pulled") == pulled + 1  # the KV crossed the link


def test_a_cut_link_makes_decode_recompute_not_fail(pair, server):
    """Last: it unplugs the prefill host."""
    prefill, decode, prefill_host = pair
    expected = collect(GrpcChat(server.grpc_url).stream(chat_inputs(BODY))).output_token_ids
    [handed] = list(GrpcChat(prefill.grpc_url).stream(chat_inputs(BODY, kv_transfer_params={"do_remote_decode": True})))
    recomputed = metric(decode, "pdchat_kv_pulls_total", outcome="recomputed")
    prefill_host.cut()
    result = collect(
        GrpcChat(decode.grpc_url).stream(
            chat_inputs(
                BODY, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params_json
            )
        )
    )
    assert result.output_token_ids == expected
    assert metric(decode, "pdchat_kv_pulls_total", outcome="recomputed") == recomputed + 1
