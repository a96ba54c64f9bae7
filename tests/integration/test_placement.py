"""decode_cpus auto on a real server: decode's scheduler thread alone on its CPU, every other
thread of every model off it, and the answers those of a server without it."""

import os
import re
from pathlib import Path

import pytest

from pdchat.clients.chat import GrpcChat
from pdchat.core.placement import CpuPlacement
from tests.integration.helpers import ask, summary

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place threads apart")
HI = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}


def thread_cpus(pid: int) -> list[frozenset[int]]:
    """The CPUs each thread of process `pid` may run on."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        [listed] = re.findall(r"Cpus_allowed_list:\s*(\S+)", status)
        cpus: set[int] = set()
        for part in listed.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
        found.append(frozenset(cpus))
    return found


def test_decode_steps_alone_on_its_cpu_and_every_other_model_thread_keeps_off(decode_server):
    placement = CpuPlacement.resolve("auto", frozenset(os.sched_getaffinity(decode_server.process.pid)), 1)
    assert decode_server.stubs, "the server's python stubs"
    for pid, (model, _) in decode_server.stubs.items():
        cpus = thread_cpus(pid)
        if model == "decode":
            assert cpus.count(placement.decode) == 1, "the scheduler thread, alone on decode's CPU"
            assert all(c in (placement.decode, placement.others) for c in cpus)
        assert cpus.count(placement.others) == len(cpus) - (model == "decode"), f"{model}'s threads"


def test_answers_are_those_of_a_server_without_placement(decode_server, server):
    placed, unplaced = GrpcChat(decode_server.grpc_url), GrpcChat(server.grpc_url)
    try:
        assert summary(ask(placed, HI)) == summary(ask(unplaced, HI))
    finally:
        placed.close()
        unplaced.close()
