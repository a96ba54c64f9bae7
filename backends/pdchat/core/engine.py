"""The model itself: HF transformers on torch, fp32 on CPU, CUDA where present.

Prefill and decode run in different processes (and later on different servers), so
the KV cache leaves the process as one numpy array and comes back bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdchat.core.errors import InvalidRequest

# KV layout on the wire: [layers, 2 (key, value), kv_heads, tokens, head_dim].
KV_TOKEN_AXIS = 3


def pick_device(preference: str) -> str:
    if preference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return preference


@dataclass
class PrefillResult:
    last_logits: torch.Tensor  # [vocab], for the first output token
    cache: object  # transformers Cache holding the prompt's KV


class CausalLM:
    """One causal LM: prefill a prompt, step one token, move KV in and out."""

    def __init__(self, model_dir: Path, device: str = "auto"):
        from transformers import AutoModelForCausalLM

        self.device = pick_device(device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        config = self.model.config
        self.context_length = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)

    @torch.inference_mode()
    def prefill(self, prompt_token_ids: list[int]) -> PrefillResult:
        self.check_prompt(prompt_token_ids)
        ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=self.device)
        # logits_to_keep=1: full-prompt logits would be vocab x tokens floats for nothing.
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return PrefillResult(out.logits[0, -1], out.cache)

    @torch.inference_mode()
    def step(self, token_id: int, cache: object) -> torch.Tensor:
        """Feed one token after `cache`; return the next token's logits (the cache grows)."""
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[0, -1]

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("the prompt has no tokens")
        if len(prompt_token_ids) >= self.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.context_length}"
            )
        low, high = min(prompt_token_ids), max(prompt_token_ids)
        if low < 0 or high >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must lie in [0, {self.vocab_size}); got values from {low} to {high}")

    def export_kv(self, cache: object) -> np.ndarray:
        """The cache as one contiguous fp32 array (see KV layout above)."""
        layers = [torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers]
        return torch.stack(layers).to("cpu", torch.float32).numpy()

    def import_kv(self, kv: np.ndarray, prompt_tokens: int) -> object:
        """Rebuild a cache from export_kv's array, checking it fits this model and prompt."""
        from transformers import DynamicCache

        if kv.ndim != 5 or kv.shape[0] != self.num_layers or kv.shape[1] != 2 or kv.shape[KV_TOKEN_AXIS] != prompt_tokens:
            raise InvalidRequest(
                f"kv_cache of shape {list(kv.shape)} does not fit this model ({self.num_layers} layers) "
                f"and a prompt of {prompt_tokens} tokens"
            )
        cache = DynamicCache(config=self.model.config)
        tensor = torch.from_numpy(np.ascontiguousarray(kv, dtype=np.float32)).to(self.device)
        for index in range(self.num_layers):
            cache.update(tensor[index, 0].unsqueeze(0), tensor[index, 1].unsqueeze(0), index)
        return cache
