"""Where the model comes from: config parameter, then environment, then the default.

Every model of the repository resolves the same way, so renderer, prefill and decode
agree on one model without repeating it in three config.pbtxt files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdchat.core.errors import ModelUnavailable

ENV_MODEL = "PDCHAT_MODEL"
ENV_DEVICE = "PDCHAT_DEVICE"
ENV_CACHE_DIR = "PDCHAT_CACHE_DIR"
ENV_FORWARDED_IDS = "PDCHAT_FORWARDED_IDS"
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    """Root of generated artefacts (embedded models, backend directory)."""
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "pdchat")


@dataclass(frozen=True)
class ModelSettings:
    """The resolved model: a Hugging Face causal-LM directory and where to run it."""

    path: Path
    device: str

    @property
    def served_name(self) -> str:
        """Name clients use in the request's `model` field: the directory's name."""
        return self.path.name


def resolve_model(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> ModelSettings:
    """Resolve the model spec (embedded name or directory) into a usable directory.

    Order: the config parameter `model`, then PDCHAT_MODEL, then the demo model.
    Embedded names are built into the cache on first use.
    """
    from pdchat import embedded  # local import: building pulls in torch

    env = os.environ if environ is None else environ
    spec = parameters.get("model") or env.get(ENV_MODEL) or DEFAULT_MODEL
    device = parameters.get("device") or env.get(ENV_DEVICE) or "auto"
    if spec in embedded.EMBEDDED_MODELS:
        return ModelSettings(embedded.ensure_model(spec), device)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(embedded.EMBEDDED_MODELS))
        raise ModelUnavailable(
            f"model path '{spec}' is not a Hugging Face model directory (no config.json there); "
            f"give a directory or one of the embedded models: {known}"
        )
    return ModelSettings(path, device)


def forwarded_ids_policy(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str:
    """The chat model's gate policy: parameter `forwarded_ids`, then PDCHAT_FORWARDED_IDS, then off."""
    env = os.environ if environ is None else environ
    return parameters.get("forwarded_ids") or env.get(ENV_FORWARDED_IDS) or "off"
