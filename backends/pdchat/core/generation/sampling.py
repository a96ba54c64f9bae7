"""Next-token choice: greedy at temperature 0, else temperature + top-p with a seed.

The random stream is keyed by (seed, output position), not by process state, so the
same request samples the same tokens whichever server computed which position.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) apart


def choose_token(logits: torch.Tensor, *, temperature: float, top_p: float, seed: int, position: int) -> int:
    """Pick the token at output `position` from 1-D `logits` over the vocabulary."""
    logits = logits.float().cpu()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    generator = torch.Generator().manual_seed((seed * _MIX + position) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=generator))
