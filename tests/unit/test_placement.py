"""decode_cpus: decode's scheduler thread on CPUs of its own, everything else off them."""

import os
import threading

import pytest

from pdchat.core import settings
from pdchat.core.errors import ModelUnavailable
from pdchat.core.generation.scheduler import DecodeScheduler
from pdchat.core.placement import CpuPlacement, bind_process, parse_cpus
from tests.integration.helpers import wait_for

TWO, EIGHT = frozenset({0, 1}), frozenset(range(8))


@pytest.mark.parametrize(("text", "cpus"), [("3", {3}), ("2-3", {2, 3}), ("0, 2-3,6", {0, 2, 3, 6}), ("1-1", {1})])
def test_cpu_lists_read_as_taskset_writes_them(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,2", "1-2-3"])
def test_a_cpu_list_that_is_none_is_refused(text):
    with pytest.raises(ValueError, match="auto, none or a CPU list"):
        parse_cpus(text)


def test_auto_gives_decode_the_last_cpus_as_many_as_its_torch_threads():
    assert CpuPlacement.resolve("auto", TWO, 1) == CpuPlacement(frozenset({1}), frozenset({0}))
    assert CpuPlacement.resolve("auto", EIGHT, 4) == CpuPlacement(frozenset({4, 5, 6, 7}), frozenset({0, 1, 2, 3}))
    assert CpuPlacement.resolve("auto", TWO, 4).others == {0}  # at least one left for the rest


def test_auto_binds_nothing_on_one_cpu_and_none_binds_nothing():
    assert CpuPlacement.resolve("auto", frozenset({5}), 1) is None
    assert CpuPlacement.resolve("none", EIGHT, 1) is None


def test_named_cpus_must_be_some_of_the_process_s():
    assert CpuPlacement.resolve(frozenset({2}), EIGHT, 1) == CpuPlacement(frozenset({2}), EIGHT - {2})
    with pytest.raises(ValueError, match="CPUs 8-9, outside this process's 0-7"):
        CpuPlacement.resolve(frozenset({7, 8, 9}), EIGHT, 1)
    with pytest.raises(ValueError, match="takes every CPU"):
        CpuPlacement.resolve(TWO, TWO, 1)


def test_the_setting_names_itself_when_it_cannot_be_had():
    outside = str(max(os.sched_getaffinity(0)) + 1)
    with pytest.raises(ModelUnavailable, match="parameter decode_cpus / PDCHAT_DECODE_CPUS names CPUs"):
        settings.cpu_placement({"decode_cpus": outside})
    with pytest.raises(ModelUnavailable, match="decode_cpus must be auto, none or a CPU list"):
        settings.cpu_placement({}, {"PDCHAT_DECODE_CPUS": "half"})


class _Idle:
    """A batch that never runs: the scheduler only waits."""

    def join(self, cache):
        return 0

    def leave(self, rows):
        pass

    def step(self, token_ids):
        return []

    def kv_bytes(self):
        return 0


def _affinity_of(thread_name: str) -> set[int]:
    [thread] = [t for t in threading.enumerate() if t.name == thread_name]
    return os.sched_getaffinity(thread.native_id)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place threads apart")
def test_the_scheduler_thread_runs_on_decode_s_cpus_and_the_rest_off_them():
    before = os.sched_getaffinity(0)
    placement = CpuPlacement.resolve("auto", frozenset(before), 1)
    try:
        bind_process(placement.others)
        scheduler = DecodeScheduler(_Idle(), name="pdchat-test-placed", cpus=placement.decode)
        try:
            assert wait_for(lambda: _affinity_of("pdchat-test-placed") == placement.decode, timeout=5)
            assert os.sched_getaffinity(0) == placement.others  # this thread, bound with the process
        finally:
            scheduler.close()
    finally:
        bind_process(frozenset(before))
