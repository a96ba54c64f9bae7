"""`x @ W^T` on CPU by oneDNN over the weight in its blocked layout, whatever x's rows.

torch's fp32 GEMM multiplies by `nn.Linear`'s [out, in] weight transposed, and converts its
layout on every call. oneDNN over the weight reordered once into its blocked layout (what
vLLM's CPU backend does for its linear layers) skips that: at prefill's rows (a prompt's
tokens) it runs 1.1-1.5x as fast, at a decode step's few rows up to 2x
(docs/benchmarks.md#the-forward-pass), at one row about as fast (a vocabulary's tall
projection faster, a small layer's some 10 us slower).

NOTE: batch invariance. oneDNN's kernel for two rows or more reduces each output in one
order, whatever the row count and the threads: a row's result is the same bits alone, in
any batch and in any prompt chunk. Its one-row kernel (and torch's) sums differently, so a
single row is computed as two. A seeded sampled draw then depends on its request alone;
with results equal only to rounding, a draw near a boundary of the cumulative mass (a
flat distribution's top_p edge) would differ between a request served alone and in a batch.

oneDNN makes (and caches) a primitive per shape, about 0.7 ms for each new number of rows
here, so a prompt of a length not seen before paid that for each of a layer's GEMMs. A
prompt's rows (`bucket_rows`) are padded to a multiple of PROMPT_ROW_BUCKET: its GEMMs take
one of a few shapes, made once. A decode step's rows are not (a batch's few sizes recur).
"""

from __future__ import annotations

import torch
from torch.nn import functional

# A prompt's GEMM rows are padded up to a multiple of this (RowGemm's bucket_rows).
PROMPT_ROW_BUCKET = 16


class RowGemm:
    """`x @ W^T + b` for x [..., in], W [out, in] and an optional bias b [out]: [..., out].

    - `blocked` (fp32 on CPU; oneDNN's bf16 and fp16 paths need AVX-512 or AVX-NE-CONVERT):
      oneDNN over its blocked layout of W, made here, or on the first pass when `lazy`;
      every row's result the same bits whatever the rows beside it (the module's NOTE);
    - otherwise torch's GEMM on W, or for one row on a stored W^T when
      `transposed_for_one_row` (MKL multiplies a vector by [in, out] faster than by [out,
      in] transposed: a vocabulary's tall projection).

    NOTE: the blocked layout and W^T each cost W's size again. Their results and torch's
    agree to rounding (about 1e-5 relative), not bit for bit."""

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        blocked: bool = True,
        lazy: bool = False,
        transposed_for_one_row: bool = False,
    ):
        """NOTE: the bias goes into each GEMM as nn.Linear's does (torch's and oneDNN's add
        it in the product), so on torch's GEMM the result is nn.Linear's bit for bit."""
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.blocked = blocked and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self._transposed = self.weight.t().contiguous() if transposed_for_one_row and not self.blocked else None
        self._layout = self._blocked_layout() if self.blocked and not lazy else None

    def __call__(self, x: torch.Tensor, *, bucket_rows: bool = False) -> torch.Tensor:
        """`bucket_rows`: pad x's rows for oneDNN to a multiple of PROMPT_ROW_BUCKET (a
        prompt's pass); the padding's rows are computed and dropped, as a single row's twin."""
        rows = x.numel() // x.shape[-1]
        if self.blocked:
            if self._layout is None:
                self._layout = self._blocked_layout()
            flat = x.reshape(rows, -1)
            if rows == 1:  # NOTE: two rows, for the batch invariance (module docstring)
                flat = flat.expand(2, -1).contiguous()
            elif bucket_rows and rows % PROMPT_ROW_BUCKET:
                padded = -(-rows // PROMPT_ROW_BUCKET) * PROMPT_ROW_BUCKET
                flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[1])))
            out = torch.ops.mkldnn._linear_pointwise(flat, self._layout, self.bias, "none", [None], "")[:rows]
        elif self._transposed is not None:
            flat = x.reshape(rows, -1)
            out = flat @ self._transposed if self.bias is None else torch.addmm(self.bias, flat, self._transposed)
        else:
            return functional.linear(x, self.weight, self.bias)
        return out.view(*x.shape[:-1], -1)

    def _blocked_layout(self) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
