"""The vLLM plugin that keeps NIXL's progress thread from polling with a zero timeout: every
agent nixl's Python API makes then waits PROGRESS_WAIT_US for an event, and still connects."""

from __future__ import annotations

import uuid

import pytest

from pdchat.core.vllm import quiet_nixl

api = pytest.importorskip("nixl_cu12._api")


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(api.nixlBind, "nixlAgentConfig", api.nixlBind.nixlAgentConfig)  # restored after
    quiet_nixl.install()
    quiet_nixl.install()  # vLLM may load a plugin twice in a process
    return api.nixlBind.nixlAgentConfig


def test_the_agents_progress_thread_waits_instead_of_polling(installed):
    config = installed()
    config.pthrDelay = 0  # what nixl_agent sets
    assert config.pthrDelay == quiet_nixl.PROGRESS_WAIT_US
    config.pthrDelay = 10 * quiet_nixl.PROGRESS_WAIT_US  # a longer wait asked for is kept
    assert config.pthrDelay == 10 * quiet_nixl.PROGRESS_WAIT_US
    assert installed.__mro__[1].__name__ == "nixlAgentConfig"  # installed once, over nixl's own


def test_an_agent_made_as_vllm_makes_it_still_serves_its_metadata(installed):
    agent = api.nixl_agent(f"test-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(num_threads=4))
    assert agent.get_agent_metadata()


def test_a_classs_init_keeps_thread_affinities_and_is_wrapped_once():
    import os

    class Pinning:
        def __init__(self, cpus):
            os.sched_setaffinity(0, cpus)
            self.made = True

    before = os.sched_getaffinity(0)
    quiet_nixl.keep_thread_affinity(Pinning)
    quiet_nixl.keep_thread_affinity(Pinning)
    assert Pinning({min(before)}).made
    assert os.sched_getaffinity(0) == before and os.sched_setaffinity.__name__ == "sched_setaffinity"
    assert Pinning.__init__.__wrapped__.__qualname__.endswith("Pinning.__init__")  # one wrapper
