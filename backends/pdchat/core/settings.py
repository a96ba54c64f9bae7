"""Where the model comes from: config parameter, then environment, then the default.

Every model of the repository resolves the same way, so renderer, prefill and decode
agree on one model without repeating it in three config.pbtxt files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdchat import tensors
from pdchat.core.errors import ModelUnavailable

ENV_MODEL = "PDCHAT_MODEL"
ENV_DEVICE = "PDCHAT_DEVICE"
ENV_CACHE_DIR = "PDCHAT_CACHE_DIR"
ENV_FORWARDED_IDS = "PDCHAT_FORWARDED_IDS"
ENV_HANDOFF_TTL_S = "PDCHAT_HANDOFF_TTL_S"
ENV_KV_CONNECTOR = "PDCHAT_KV_CONNECTOR"
ENV_KV_TTL_S = "PDCHAT_KV_TTL_S"
ENV_KV_BUDGET_MB = "PDCHAT_KV_BUDGET_MB"
ENV_MAX_RUNNING = "PDCHAT_MAX_RUNNING"
ENV_DECODE_KV_MB = "PDCHAT_DECODE_KV_MB"
ENV_QUEUE_TIMEOUT_S = "PDCHAT_QUEUE_TIMEOUT_S"
ENV_PREFILL_CHUNK = "PDCHAT_PREFILL_CHUNK"
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    """Root of generated artefacts (embedded models, backend directory)."""
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "pdchat")


def setting(parameters: dict[str, str], key: str, env_name: str, default: str, environ=None) -> str:
    """A config parameter if the model's config.pbtxt sets it, else the environment, else the default."""
    env = os.environ if environ is None else environ
    return parameters.get(key) or env.get(env_name) or default


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

    spec = setting(parameters, tensors.PARAM_MODEL, ENV_MODEL, DEFAULT_MODEL, environ)
    device = setting(parameters, tensors.PARAM_DEVICE, ENV_DEVICE, "auto", environ)
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
    return setting(parameters, tensors.PARAM_FORWARDED_IDS, ENV_FORWARDED_IDS, "off", environ)


def handoff_ttl_s(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> float:
    """How long signed handoffs stay valid: `handoff_ttl_s`, then PDCHAT_HANDOFF_TTL_S, then 60 s."""
    return _positive(setting(parameters, tensors.PARAM_HANDOFF_TTL_S, ENV_HANDOFF_TTL_S, "60", environ), "handoff TTL")


def kv_connector(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str:
    """The connector prefill publishes KV through: `kv_connector`, then PDCHAT_KV_CONNECTOR, then shm."""
    name = setting(parameters, tensors.PARAM_KV_CONNECTOR, ENV_KV_CONNECTOR, "shm", environ)
    if name not in ("shm", "nixl"):
        raise ModelUnavailable(f"kv_connector must be shm or nixl, got {name!r}")
    return name


def kv_options(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> dict[str, float | int]:
    """How long prefill holds unpulled KV (PDCHAT_KV_TTL_S, 60 s) and how much (PDCHAT_KV_BUDGET_MB, 2048)."""
    ttl = _positive(setting(parameters, tensors.PARAM_KV_TTL_S, ENV_KV_TTL_S, "60", environ), "KV TTL")
    budget = _positive(setting(parameters, tensors.PARAM_KV_BUDGET_MB, ENV_KV_BUDGET_MB, "2048", environ), "KV budget")
    return {"ttl_s": ttl, "budget_bytes": int(budget * (1 << 20))}


@dataclass(frozen=True)
class BatchingOptions:
    max_running: int  # sequences in one decode batch
    kv_budget_bytes: int  # KV those sequences may reserve (prompt + max_tokens each)
    queue_timeout_s: float  # longest wait for room, then UNAVAILABLE
    prefill_chunk: int  # prompt tokens per local prefill chunk, between decode steps


def batching_options(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> BatchingOptions:
    """Decode's limits: max_running (PDCHAT_MAX_RUNNING, 32), decode_kv_mb (PDCHAT_DECODE_KV_MB,
    1024), queue_timeout_s (PDCHAT_QUEUE_TIMEOUT_S, 30), prefill_chunk (PDCHAT_PREFILL_CHUNK, 512)."""

    def number(key: str, env_name: str, default: str, what: str) -> float:
        return _positive(setting(parameters, key, env_name, default, environ), what)

    return BatchingOptions(
        max_running=int(number(tensors.PARAM_MAX_RUNNING, ENV_MAX_RUNNING, "32", "max_running")),
        kv_budget_bytes=int(number(tensors.PARAM_DECODE_KV_MB, ENV_DECODE_KV_MB, "1024", "decode_kv_mb") * (1 << 20)),
        queue_timeout_s=number(tensors.PARAM_QUEUE_TIMEOUT_S, ENV_QUEUE_TIMEOUT_S, "30", "queue_timeout_s"),
        prefill_chunk=int(number(tensors.PARAM_PREFILL_CHUNK, ENV_PREFILL_CHUNK, "512", "prefill_chunk")),
    )


def _positive(value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ModelUnavailable(f"{what} must be a number, got {value!r}") from None
    if number <= 0:
        raise ModelUnavailable(f"{what} must be positive, got {number}")
    return number
