"""A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in its engine
core and worker processes): NIXL agents whose progress thread sleeps when there is nothing
to progress.

nixl's Python API (nixl-cu12 1.5.1) makes every agent with `pthrDelay = 0` and does not let
its caller choose: UCX's progress thread then polls with a zero timeout and keeps a core busy
for as long as the agent lives, idle or not. vLLM's NixlConnector makes such an agent in every
prefill and decode engine, so on a small host a P/D pair of vLLM engines starves itself
(docs/engines.md). With a wait of PROGRESS_WAIT_US the thread blocks in poll() until UCX
signals an event or the wait ends: measured alone, 1.00 core idle becomes 0.03.

Installed with pdchat into the venv of engine=vllm's models, it applies to every vLLM process
started from that venv (`vllm serve` too). Nothing changes where nixl is not installed.
"""

from __future__ import annotations

import logging

# How long NIXL's progress thread waits for an event before it looks again (microseconds).
PROGRESS_WAIT_US = 100

logger = logging.getLogger(__name__)


def install() -> None:
    """Make nixl's agents with a progress thread that waits up to PROGRESS_WAIT_US.

    NOTE: idempotent (vLLM may load general plugins more than once in a process)."""
    try:
        import nixl_cu12._api as api
    except ImportError:
        return
    config = api.nixlBind.nixlAgentConfig
    if getattr(config, "pdchat_waits", False):
        return

    class WaitingAgentConfig(config):
        pdchat_waits = True

        def __setattr__(self, name: str, value: object) -> None:
            if name == "pthrDelay":
                value = max(int(value), PROGRESS_WAIT_US)
            super().__setattr__(name, value)

    api.nixlBind.nixlAgentConfig = WaitingAgentConfig
    logger.debug("NIXL agents' progress thread waits up to %d us when idle", PROGRESS_WAIT_US)
