"""A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in its engine
core and worker processes): NIXL that leaves the CPUs to the engine.

- **A progress thread that waits.** nixl's Python API (nixl-cu12 1.5.1) makes every agent with
  `pthrDelay = 0` and does not let its caller choose: UCX's progress thread then polls with a
  zero timeout and keeps a core busy for as long as the agent lives, idle or not. vLLM's
  NixlConnector makes such an agent in every prefill and decode engine, so on a small host a
  P/D pair of vLLM engines starves itself (docs/engines.md). With a wait of PROGRESS_WAIT_US
  the thread blocks in poll() until UCX signals an event or the wait ends: measured alone,
  1.00 core idle becomes 0.03.
- **No pinned forward pass.** On a CPU, vLLM's NixlConnector worker pins the thread that makes
  it to the last core of each NUMA node (`os.sched_setaffinity(0, ...)`, meant to keep KV loads
  off the forward pass's cores). In an engine core that runs its model itself (vLLM's uniproc
  executor, as engine=vllm and `vllm serve` with one worker run it on a CPU) that thread is
  the forward pass's, and every engine on the host ends up on the same core: a P/D pair's
  prefill and decode engines on one host take turns on one core while the others idle. The
  worker's affinity calls are ignored; its threads keep the process's CPUs.

Installed with pdchat into the venv of engine=vllm's models, it applies to every vLLM process
started from that venv (`vllm serve` too). Nothing changes where nixl is not installed.
"""

from __future__ import annotations

import functools
import logging
import os

# How long NIXL's progress thread waits for an event before it looks again (microseconds).
PROGRESS_WAIT_US = 100
# vLLM's NixlConnector worker, whose __init__ pins its thread on a CPU (vLLM 0.32).
NIXL_WORKER = ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "NixlBaseConnectorWorker")

logger = logging.getLogger(__name__)


def install() -> None:
    """Make nixl's agents with a progress thread that waits up to PROGRESS_WAIT_US, and vLLM's
    NixlConnector worker without its thread pinning.

    NOTE: idempotent (vLLM may load general plugins more than once in a process)."""
    try:
        import nixl_cu12._api as api
    except ImportError:
        return
    config = api.nixlBind.nixlAgentConfig
    if not getattr(config, "pdchat_waits", False):

        class WaitingAgentConfig(config):
            pdchat_waits = True

            def __setattr__(self, name: str, value: object) -> None:
                if name == "pthrDelay":
                    value = max(int(value), PROGRESS_WAIT_US)
                super().__setattr__(name, value)

        api.nixlBind.nixlAgentConfig = WaitingAgentConfig
        logger.debug("NIXL agents' progress thread waits up to %d us when idle", PROGRESS_WAIT_US)
    try:
        module = __import__(NIXL_WORKER[0], fromlist=[NIXL_WORKER[1]])
    except ImportError:  # no vLLM here (or another layout): nothing pins
        return
    worker = getattr(module, NIXL_WORKER[1], None)
    if worker is not None:
        keep_thread_affinity(worker)


def keep_thread_affinity(cls: type) -> None:
    """Make `cls.__init__` leave thread CPU affinities as they are: its calls to
    os.sched_setaffinity are ignored (each logged). Idempotent.

    NOTE: os.sched_setaffinity is swapped for the duration of the call, so an affinity another
    thread sets meanwhile is ignored too; vLLM makes its connector worker while its engine
    core starts, before it serves."""
    original = cls.__init__
    if getattr(original, "pdchat_keeps_affinity", False):
        return

    @functools.wraps(original)
    def init_keeping_affinity(self, *args, **kwargs):
        setaffinity = os.sched_setaffinity

        def ignored(pid: int, cpus) -> None:
            logger.info(
                "%s: not pinning thread %d to CPUs %s (pdchat keeps the process's CPUs)", cls.__name__, pid, cpus
            )

        os.sched_setaffinity = ignored
        try:
            original(self, *args, **kwargs)
        finally:
            os.sched_setaffinity = setaffinity

    init_keeping_affinity.pdchat_keeps_affinity = True
    cls.__init__ = init_keeping_affinity
