"""The engine a prefill or decode instance runs, as the settings choose (core.engine_api).

Setting ENGINE: pdchat's own (core.generation.stage_engine.PdchatEngine) or vLLM's
(core.vllm.engine.VllmEngine), behind the same interface, so the stage models do not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdchat.core.engine_api import Engine
    from pdchat.core.placement import CpuPlacement
    from pdchat.models import ModelSettings


def open_engine(
    role: str, settings: ModelSettings, parameters: dict[str, str], instance: str, cpus: CpuPlacement | None = None
) -> Engine:
    """The engine of a `prefill` or `decode` (`role`) instance named `instance`, loaded where
    `settings` place it, configured by the stage's `parameters`, its decode thread on `cpus`'
    decode cores (setting decode_cpus: the caller bound the process off them before anything
    started threads); not started."""
    from pdchat.core.settings import ENGINE

    if ENGINE.get(parameters) == "vllm":
        from pdchat.core.vllm.engine import VllmEngine

        return VllmEngine.for_stage(role, settings, parameters, instance)
    from pdchat.core.generation.stage_engine import PdchatEngine

    return PdchatEngine.for_stage(role, settings, parameters, instance, cpus)
