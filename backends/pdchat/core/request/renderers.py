"""Which renderer a model needs: Harmony for GPT-OSS, its own chat template otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdchat.core import settings
from pdchat.core.request.harmony_vocab import uses_harmony
from pdchat.core.request.rendering import ChatRenderer, PromptRenderer


def load_renderer(
    model_dir: Path, served_name: str | Sequence[str], parameters: dict[str, str] | None = None
) -> PromptRenderer:
    """The model's renderer, with the model config's render settings (else the environment's);
    `served_name`: the name or names a request may give as its `model`, the first reported."""
    parameters = parameters or {}
    if uses_harmony(model_dir):
        from pdchat.core.request.harmony import HarmonyRenderer

        return HarmonyRenderer(model_dir, served_name, current_date=settings.current_date(parameters))
    return ChatRenderer(
        model_dir,
        served_name,
        allow_request_templates=settings.allow_request_templates(parameters),
        render_timeout_s=settings.render_timeout_s(parameters),
    )
