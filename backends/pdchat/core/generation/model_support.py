"""Which model families pdchat's engine computes exactly, and the check every stage makes at load.

pdchat's engine runs a model through its own forward (Llama, Qwen2, Qwen3) or transformers'
forward with pdchat's paged attention in place of transformers' (core.generation.paged).
That attention honours causal masks, GQA, a sliding window and attention sinks; a model that
needs more of its attention (a logit softcap), keeps another kind of state (recurrent or
linear-attention layers) or caches another shape of KV (multi-head latent attention) would
run, wrongly, or fail mid-request. So a model is served only where its family is in
`SUPPORTED` (each checked token for token against transformers' `generate` on a seeded tiny
model of that family) and its config asks for nothing in `UNHONOURED`; anything else is
refused at load, naming what is unsupported and the setting that overrides the refusal
(allow_unsupported_model: the operator takes the risk of wrong outputs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdchat.core.errors import ModelUnavailable
from pdchat.core.settings import ALLOW_UNSUPPORTED_MODEL

# config.json's model_type -> how pdchat computes it.
SUPPORTED = {
    "llama": "own Llama forward (transformers' for what it does not cover)",
    "gpt_oss": "transformers' forward with paged attention (sliding window, attention sinks)",
    "qwen2": "own forward (q, k and v biases; transformers' for what it does not cover)",
    "qwen3": "own forward (per-head q and k norms; transformers' for what it does not cover)",
    "mistral": "transformers' forward with paged attention (sliding window)",
    "gemma3_text": "transformers' forward with paged attention (sliding window)",
}
# Config fields whose presence (a value other than None, False or 0) asks for what the paged
# attention or the engine does not do.
UNHONOURED = {
    "attn_logit_softcapping": "attention logit softcapping",
    "final_logit_softcapping": "final logit softcapping",
    "kv_lora_rank": "multi-head latent attention",
    "linear_attention": "linear-attention layers",
}
# layer_types entries the paged attention computes; any other (linear_attention, mamba, ...)
# is a layer with state of another kind.
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


def unsupported_features(config: dict[str, Any]) -> list[str]:
    """What `config` (a config.json's fields) asks for that pdchat's engine does not compute;
    empty for a model it serves exactly."""
    family = config.get("model_type")
    found = [] if family in SUPPORTED else [f"the model family {family!r}"]
    found += [f"{what} ({name})" for name, what in UNHONOURED.items() if config.get(name)]
    other_layers = sorted(set(config.get("layer_types") or ()) - ATTENTION_LAYERS)
    if other_layers:
        found.append(f"layers that are not attention (layer_types {', '.join(other_layers)})")
    return found


def check_supported(model_dir: Path, allowed: bool) -> None:
    """ModelUnavailable naming what the model at `model_dir` needs that pdchat's engine does not
    compute, unless `allowed` (setting allow_unsupported_model)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    found = unsupported_features(config)
    if not found or allowed:
        return
    architecture = ", ".join(config.get("architectures") or [str(config.get("model_type"))])
    families = ", ".join(sorted(SUPPORTED))
    raise ModelUnavailable(
        f"{architecture} at {model_dir} needs what pdchat's engine does not compute: {'; '.join(found)}. "
        f"Supported families: {families} (docs/models.md). Set {ALLOW_UNSUPPORTED_MODEL.name}=true to serve it anyway, "
        "at the risk of wrong outputs"
    )
