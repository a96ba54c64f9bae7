"""The names the CLI, the launcher and the settings share: roles, KV connectors, models.

One list each, so a new role or connector is added in one place.
"""

from __future__ import annotations

# Server roles. `monolithic` serves chat's plain config.pbtxt; the others are the names of
# chat's configs/<role>.pbtxt, chosen with tritonserver --model-config-name.
MONOLITHIC, PREFILL, DECODE = "monolithic", "prefill", "decode"
ROLES = (MONOLITHIC, PREFILL, DECODE)

# KV connectors: shm (same host) and nixl (NIXL over UCX, across hosts).
SHM, NIXL = "shm", "nixl"
KV_CONNECTORS = (SHM, NIXL)
# The KV of an engine that moves it itself (engine=vllm: vLLM's NixlConnector); its handle
# carries the engine's transfer parameters, and no pdchat connector touches it.
ENGINE_KV = "engine"

# Embedded models (built offline into the cache): name -> directory and served model name.
TINY, SMOLLM2, TINY_GPTOSS, TINY_QWEN3 = "tiny", "smollm2", "tiny-gptoss", "tiny-qwen3"
EMBEDDED_MODELS = {
    TINY: "tiny-llama",
    SMOLLM2: "SmolLM2-135M-Instruct",
    TINY_GPTOSS: "tiny-gptoss",
    TINY_QWEN3: "tiny-qwen3",
}
DEFAULT_MODEL = SMOLLM2
