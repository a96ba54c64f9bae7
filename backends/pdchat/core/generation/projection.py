"""`x @ W^T` on CPU by the GEMM that is fastest for x's number of rows.

torch's fp32 GEMM multiplies by `nn.Linear`'s [out, in] weight transposed, and converts its
layout on every call. oneDNN over the weight reordered once into its blocked layout (what
vLLM's CPU backend does for its linear layers) skips that: at prefill's rows (a prompt's
tokens) it runs 1.1-1.5x as fast, at a decode step's few rows up to 2x
(docs/benchmarks.md#the-forward-pass). At one row torch's GEMM is the faster, so it keeps it.

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

    - one row: torch's GEMM on W, or on a stored W^T when `transposed_for_one_row` (MKL
      multiplies a vector by [in, out] faster than by [out, in] transposed: the
      vocabulary's tall projection; where oneDNN does not run, W^T serves every row);
    - more rows, with `blocked`: oneDNN over its blocked layout of W, made here, or on the
      first such pass when `lazy`. fp32 on CPU only: oneDNN's bf16 and fp16 paths need
      AVX-512 or AVX-NE-CONVERT.

    NOTE: the blocked layout and W^T each cost W's size again. The results of the two GEMMs
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
        self._transposed = self.weight.t().contiguous() if transposed_for_one_row else None
        self._layout = self._blocked_layout() if self.blocked and not lazy else None

    def __call__(self, x: torch.Tensor, *, bucket_rows: bool = False) -> torch.Tensor:
        """`bucket_rows`: pad x's rows for oneDNN to a multiple of PROMPT_ROW_BUCKET (a
        prompt's pass); the padding's rows are computed and dropped."""
        rows = x.numel() // x.shape[-1]
        if rows > 1 and self.blocked:
            if self._layout is None:
                self._layout = self._blocked_layout()
            flat = x.reshape(rows, -1)
            padded = -(-rows // PROMPT_ROW_BUCKET) * PROMPT_ROW_BUCKET if bucket_rows else rows
            if padded != rows:
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
