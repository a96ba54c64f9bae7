"""What pdchat asks of vLLM's engine, as plain data (no vLLM import, so it is unit-tested
without vLLM): the engine's arguments from pdchat's settings, each request's sampling
parameters from its GenerationParams, and vLLM's logprobs in pdchat's form.

NOTE: stop strings are not vLLM's to match: pdchat's own AnswerText matches them on the
tokens vLLM streams (as on pdchat's engine) and aborts vLLM's request, so vLLM runs without
detokenizing.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdchat.core.engine_api import DECODE, PREFILL
from pdchat.core.errors import ModelUnavailable
from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.core.request.protocol import GenerationParams
from pdchat.core.settings import (
    DECODE_CPUS,
    DECODE_KV_SHARE,
    FORWARD,
    GRAMMAR_CACHE_MB,
    GRAMMAR_COMPILE_TIMEOUT_S,
    GRAMMAR_WORKER_MB,
    KV_TTL_S,
    MAX_RUNNING,
    PREFILL_BATCH_TOKENS,
    PREFILL_CHUNK,
    PREFILL_PASS_TOKENS,
    PREFILL_TAKES_CORES_MS,
    PREFILL_THREADS_WHEN_IDLE,
    PREFIX_CACHING,
    QUEUE_TIMEOUT_S,
    TORCH_THREADS,
    VLLM_ENGINE_ARGS,
    VLLM_KV_CONNECTOR,
    Setting,
    kv_events_options,
)
from pdchat.models import ModelSettings

NIXL_CONNECTOR = "NixlConnector"
# What a decode engine with a prefill engine's kv_transfer_params does where the pull fails
# (prefill gone, blocks expired): compute the prompt from its ids, never fail the request.
KV_LOAD_FAILURE_POLICY = "recompute"
# How much longer than a handle is valid prefill's engine keeps its blocks (clocks of two hosts differ).
LEASE_MARGIN_S = 15
# Prefill's request to vLLM's NixlConnector: keep the prompt's blocks for a decode engine to read.
REMOTE_DECODE = {"do_remote_decode": True}
# pdchat's engine's own forward, threads, scheduling, admission and grammar compiler: vLLM's
# engine has its own (its structured-output backend compiles the grammars).
NOT_APPLIED = (
    FORWARD,
    TORCH_THREADS,
    PREFILL_THREADS_WHEN_IDLE,
    PREFILL_TAKES_CORES_MS,
    DECODE_CPUS,
    PREFILL_PASS_TOKENS,
    PREFILL_BATCH_TOKENS,
    PREFILL_CHUNK,
    DECODE_KV_SHARE,
    QUEUE_TIMEOUT_S,
    GRAMMAR_COMPILE_TIMEOUT_S,
    GRAMMAR_CACHE_MB,
    GRAMMAR_WORKER_MB,
)


def refuse_unapplied_settings(
    role: str, parameters: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> None:
    """ModelUnavailable naming each setting of NOT_APPLIED that a `role` instance reads and
    its config or environment sets to other than its default: vLLM's engine would not apply
    it, and an operator who set it must not believe it holds."""
    unapplied: list[Setting] = [
        setting
        for setting in NOT_APPLIED
        if role in setting.applies_to
        and setting.set_by(parameters, environ)
        and setting.get(parameters, environ) != setting.default_value
    ]
    if unapplied:
        named = ", ".join(f"{setting.name} ({setting.set_by(parameters, environ)})" for setting in unapplied)
        raise ModelUnavailable(
            f"{named}: not applied with setting engine vllm (vLLM's engine schedules, threads and admits by its "
            "own rules); unset them, or run engine pdchat (docs/engines.md)"
        )


def user_engine_arguments(parameters: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Setting VLLM_ENGINE_ARGS: a JSON object, or the path of a file holding one; {} unset.
    ModelUnavailable naming the setting where it is neither."""
    text = VLLM_ENGINE_ARGS.get(parameters, environ).strip()
    if not text:
        return {}
    source = "its text"
    if not text.startswith(("{", "[")):  # else a file path
        source = text
        try:
            text = Path(text).expanduser().read_text()
        except OSError as exc:
            raise ModelUnavailable(f"{VLLM_ENGINE_ARGS.names}: cannot read {source}: {exc}") from None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ModelUnavailable(f"{VLLM_ENGINE_ARGS.names}: {source} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelUnavailable(f"{VLLM_ENGINE_ARGS.names}: {source} must be a JSON object of engine arguments")
    return value


def engine_arguments(
    role: str,
    settings: ModelSettings,
    parameters: Mapping[str, str],
    instance: str,
    *,
    on_cpu: bool,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs for a `prefill` or `decode` (`role`) instance: the model, its
    served name and dtype (pdchat's `auto`: float32 on CPU, the model's own on GPU), a fixed
    seed, prefix caching and decode's batch as pdchat's settings say, each prompt prefilled
    in one pass on CPU, KV events where their
    endpoint is set, and vLLM's NixlConnector unless setting VLLM_KV_CONNECTOR says not
    (prefill produces KV and keeps it past its handle's expiry, decode consumes it and
    recomputes what it cannot pull); then
    setting VLLM_ENGINE_ARGS over all of it."""
    if role not in (PREFILL, DECODE):
        raise ValueError(f"an engine serves prefill or decode, not {role!r}")
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "float32" if on_cpu else "auto"
    arguments: dict[str, Any] = {
        "model": str(settings.path),
        "served_model_name": settings.served_name,
        "dtype": dtype,
        "seed": 0,
        "enable_prefix_caching": PREFIX_CACHING.get(parameters, environ),
        "disable_log_stats": False,
    }
    if on_cpu:
        # NOTE: vLLM's CPU runner fails its engine core on a seeded request whose prompt it
        # prefills in chunks (it rewinds the request's generator, which CPU generators cannot),
        # and pdchat seeds every request: each prompt goes in one pass instead.
        arguments["enable_chunked_prefill"] = False
    if VLLM_KV_CONNECTOR.get(parameters, environ):
        arguments["kv_transfer_config"] = {
            "kv_connector": NIXL_CONNECTOR,
            "kv_role": "kv_producer" if role == PREFILL else "kv_consumer",
            "kv_buffer_device": "cpu" if on_cpu else "cuda",
            "kv_load_failure_policy": KV_LOAD_FAILURE_POLICY,
            "engine_id": f"{instance.replace(' ', '-')}-{uuid.uuid4().hex[:8]}",
            # NOTE: prefill keeps a prompt's blocks past its handle's expiry (setting kv_ttl_s), so
            # a decode server with a valid handle never reads blocks handed to another request.
            "kv_connector_extra_config": {
                "kv_lease_duration": math.ceil(KV_TTL_S.get(parameters, environ)) + LEASE_MARGIN_S
            },
        }
    if role == DECODE:
        arguments["max_num_seqs"] = MAX_RUNNING.get(parameters, environ)
    events = kv_events_options(role, dict(parameters), environ)
    if events is not None:
        arguments["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events.endpoint,
            "replay_endpoint": events.replay_endpoint,
            "topic": events.topic,
            "buffer_steps": events.buffer_steps,
        }
    arguments.update(user_engine_arguments(parameters, environ))
    return arguments


def cpu_kv_cache_gib(pool_bytes: int) -> int:
    """vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB) for pdchat's pool size: at least 1."""
    return max(1, math.ceil(pool_bytes / (1 << 30)))


def sampling_arguments(
    params: GenerationParams, *, prefill: bool = False, transfer_params: dict | None = None
) -> dict[str, Any]:
    """vLLM's SamplingParams for a request, as keyword arguments: every sampling control of
    `params` (already checked by GenerationParams.check) but its stop strings and grammar
    (the engine adds vLLM's form of the grammar); one token for `prefill`, with the ask to
    keep its KV for a decode engine; a decode engine's `transfer_params` from that prefill."""
    arguments: dict[str, Any] = {
        "n": 1,
        "max_tokens": 1 if prefill else params.max_tokens,
        "min_tokens": min(params.min_tokens, 1) if prefill else params.min_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": {int(token): bias for token, bias in params.logit_bias.items()} or None,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.top_logprobs if params.logprobs else None,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    kv = REMOTE_DECODE if prefill else transfer_params
    if kv is not None:
        arguments["extra_args"] = {"kv_transfer_params": dict(kv)}
    return arguments


def token_logprobs(token_id: int, entries: Mapping[int, Any], top: int) -> TokenLogprobs:
    """One token's logprobs in pdchat's form from vLLM's entry for it (token id -> Logprob
    with `logprob` and `rank`, the sampled token and the `top` most likely), those `top`
    most likely first."""
    ranked = sorted(
        ((entry.rank, token, entry.logprob) for token, entry in entries.items() if entry.rank is not None),
        key=lambda item: item[0],
    )
    alternatives = tuple((token, float(logprob)) for rank, token, logprob in ranked if rank <= top)
    return TokenLogprobs(token_id, float(entries[token_id].logprob), alternatives[:top])
