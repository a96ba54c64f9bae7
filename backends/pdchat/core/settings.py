"""Every setting of a pdchat model: its config.pbtxt parameter, its environment variable,
its default, in that order of precedence.

The names live here only: the launcher, the CLI and the tests import them. Every model
resolves the same way, so renderer, prefill and decode agree on one model without
repeating it in several config.pbtxt files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdchat import registry
from pdchat.core.errors import ModelUnavailable

# Model config parameters (config.pbtxt `parameters`).
PARAM_MODEL = "model"  # embedded model name or HF model directory
PARAM_DEVICE = "device"  # "auto" (CUDA when present), "cpu" or "cuda"
PARAM_DTYPE = "dtype"  # "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16", "float16"
PARAM_TORCH_THREADS = "torch_threads"  # prefill, decode: torch's CPU threads ("auto": half the cores)
PARAM_FORWARDED_IDS = "forwarded_ids"  # chat: off | signed | trusted
PARAM_HANDOFF_TTL_S = "handoff_ttl_s"  # chat: seconds a signed handoff stays valid
PARAM_KV_CONNECTOR = "kv_connector"  # chat (prefill role): shm | nixl
PARAM_KV_TTL_S = "kv_ttl_s"  # prefill: seconds unpulled KV is held
PARAM_KV_BUDGET_MB = "kv_budget_mb"  # prefill: most KV held at once
PARAM_MAX_RUNNING = "max_running"  # decode: sequences batched at once
PARAM_DECODE_KV_MB = "decode_kv_mb"  # decode: KV its running sequences may reserve
PARAM_QUEUE_TIMEOUT_S = "queue_timeout_s"  # decode: longest wait for room before UNAVAILABLE
PARAM_PREFILL_CHUNK = "prefill_chunk"  # decode: prompt tokens per local prefill chunk
PARAM_MAX_REQUEST_BYTES = "max_request_bytes"  # chat, renderer: largest request body taken
PARAM_STAGE_LANES = "stage_lanes"  # chat: blocking calls to renderer and prefill at once

# Environment variables, used where a config leaves the parameter out.
ENV_MODEL = "PDCHAT_MODEL"
ENV_HANDOFF_KEY = "PDCHAT_HANDOFF_KEY"  # the deployment's shared secret (at least 16 bytes)
ENV_HANDOFF_KEY_FILE = "PDCHAT_HANDOFF_KEY_FILE"  # or a file holding it
# Seals stage inputs (renderer/prefill/decode accept only what this server's renderer or gate made).
ENV_STAGE_KEY = "PDCHAT_STAGE_KEY"
ENV_KV_PULL_TIMEOUT_S = "PDCHAT_KV_PULL_TIMEOUT_S"  # decode: longest NIXL READ before recomputing (30 s)
ENV_API_KEY = "PDCHAT_API_KEY"  # the router's bearer token (pdchat router --api-key)
ENV_DEVICE = "PDCHAT_DEVICE"
ENV_DTYPE = "PDCHAT_DTYPE"
ENV_TORCH_THREADS = "PDCHAT_TORCH_THREADS"
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
ENV_MAX_REQUEST_BYTES = "PDCHAT_MAX_REQUEST_BYTES"
ENV_STAGE_LANES = "PDCHAT_STAGE_LANES"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # the router's default body limit too


def cache_dir() -> Path:
    """Root of generated artefacts (embedded models, backend directory)."""
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "pdchat")


def setting(parameters: dict[str, str], key: str, env_name: str, default: str, environ=None) -> str:
    """A config parameter if the model's config.pbtxt sets it, else the environment, else the default."""
    env = os.environ if environ is None else environ
    return parameters.get(key) or env.get(env_name) or default


def forwarded_ids_policy(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str:
    """The chat model's gate policy: parameter `forwarded_ids`, then PDCHAT_FORWARDED_IDS, then off."""
    return setting(parameters, PARAM_FORWARDED_IDS, ENV_FORWARDED_IDS, "off", environ)


def handoff_ttl_s(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> float:
    """How long signed handoffs stay valid: `handoff_ttl_s`, then PDCHAT_HANDOFF_TTL_S, then 60 s."""
    return _positive(setting(parameters, PARAM_HANDOFF_TTL_S, ENV_HANDOFF_TTL_S, "60", environ), "handoff TTL")


def kv_connector(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str:
    """The connector prefill publishes KV through: `kv_connector`, then PDCHAT_KV_CONNECTOR, then shm."""
    name = setting(parameters, PARAM_KV_CONNECTOR, ENV_KV_CONNECTOR, registry.SHM, environ)
    if name not in registry.KV_CONNECTORS:
        raise ModelUnavailable(f"kv_connector must be one of {', '.join(registry.KV_CONNECTORS)}, got {name!r}")
    return name


def kv_options(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> dict[str, float | int]:
    """How long prefill holds unpulled KV (PDCHAT_KV_TTL_S, 60 s) and how much (PDCHAT_KV_BUDGET_MB, 2048)."""
    ttl = _positive(setting(parameters, PARAM_KV_TTL_S, ENV_KV_TTL_S, "60", environ), "KV TTL")
    budget = _positive(setting(parameters, PARAM_KV_BUDGET_MB, ENV_KV_BUDGET_MB, "2048", environ), "KV budget")
    return {"ttl_s": ttl, "budget_bytes": int(budget * (1 << 20))}


def max_request_bytes(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """Largest `request` (or `text_input`) chat and the renderer take: max_request_bytes,
    then PDCHAT_MAX_REQUEST_BYTES, then 4 MiB."""
    value = setting(parameters, PARAM_MAX_REQUEST_BYTES, ENV_MAX_REQUEST_BYTES, str(DEFAULT_MAX_REQUEST_BYTES), environ)
    return int(_positive(value, "max_request_bytes"))


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
        max_running=int(number(PARAM_MAX_RUNNING, ENV_MAX_RUNNING, "32", "max_running")),
        kv_budget_bytes=int(number(PARAM_DECODE_KV_MB, ENV_DECODE_KV_MB, "1024", "decode_kv_mb") * (1 << 20)),
        queue_timeout_s=number(PARAM_QUEUE_TIMEOUT_S, ENV_QUEUE_TIMEOUT_S, "30", "queue_timeout_s"),
        prefill_chunk=int(number(PARAM_PREFILL_CHUNK, ENV_PREFILL_CHUNK, "512", "prefill_chunk")),
    )


def stage_lanes(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """chat's lanes for blocking BLS calls to renderer and prefill: `stage_lanes`, then
    PDCHAT_STAGE_LANES, then 2, the instances prefill's config gives it on a CPU host. Match
    prefill's instance count (on a GPU host: 2 per GPU), so that a long prompt's prefill
    holds one lane and the prompts behind it take another."""
    return int(_positive(setting(parameters, PARAM_STAGE_LANES, ENV_STAGE_LANES, "2", environ), "stage_lanes"))


def _positive(value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ModelUnavailable(f"{what} must be a number, got {value!r}") from None
    if number <= 0:
        raise ModelUnavailable(f"{what} must be positive, got {number}")
    return number


# The renderer's guard on chat templates (model_repository/renderer).
PARAM_ALLOW_REQUEST_TEMPLATES = "allow_request_templates"  # renderer: may a request bring a chat_template
PARAM_RENDER_TIMEOUT_S = "render_timeout_s"  # renderer: longest one chat template render may run
ENV_ALLOW_REQUEST_TEMPLATES = "PDCHAT_ALLOW_REQUEST_TEMPLATES"
ENV_RENDER_TIMEOUT_S = "PDCHAT_RENDER_TIMEOUT_S"
DEFAULT_RENDER_TIMEOUT_S = 2.0
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def allow_request_templates(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> bool:
    """Whether chat_template_kwargs may carry a `chat_template`: `allow_request_templates`, then
    PDCHAT_ALLOW_REQUEST_TEMPLATES, then false. The template is the server's, as in vLLM
    without --trust-request-chat-template: a request's own template bypasses it."""
    value = setting(parameters, PARAM_ALLOW_REQUEST_TEMPLATES, ENV_ALLOW_REQUEST_TEMPLATES, "false", environ)
    flag = value.strip().lower()
    if flag not in _TRUE + _FALSE:
        raise ModelUnavailable(f"allow_request_templates must be one of {', '.join(_TRUE + _FALSE)}, got {value!r}")
    return flag in _TRUE


def render_timeout_s(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> float:
    """The bound on one chat template render: `render_timeout_s`, then PDCHAT_RENDER_TIMEOUT_S, then 2 s."""
    value = setting(parameters, PARAM_RENDER_TIMEOUT_S, ENV_RENDER_TIMEOUT_S, str(DEFAULT_RENDER_TIMEOUT_S), environ)
    return _positive(value, "render timeout")


# Harmony (GPT-OSS) render inputs the server supplies (core.request.harmony).
PARAM_CURRENT_DATE = "current_date"  # renderer, chat: the conversation date Harmony's system message states
ENV_CURRENT_DATE = "PDCHAT_CURRENT_DATE"


def current_date(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str | None:
    """Harmony's conversation date: `current_date`, then PDCHAT_CURRENT_DATE, else None (today, UTC).
    Set it alike for `renderer` and `chat` (the environment does both): chat fingerprints it."""
    return setting(parameters, PARAM_CURRENT_DATE, ENV_CURRENT_DATE, "", environ) or None


def torch_threads(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """torch's CPU threads in a stage model: `torch_threads`, then PDCHAT_TORCH_THREADS, then
    half the cores (at least 1). Prefill and decode share a server's cores; each taking all
    of them makes their OpenMP threads spin against each other (README, "Models": about
    twice the tokens/s at concurrency 16 on 2 cores with one thread each). Cores are
    those this process may run on (its affinity), not the host's."""
    value = setting(parameters, PARAM_TORCH_THREADS, ENV_TORCH_THREADS, "auto", environ)
    if value == "auto":
        return max(1, len(os.sched_getaffinity(0)) // 2)
    return int(_positive(value, "torch_threads"))
