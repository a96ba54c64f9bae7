"""RowGemm: torch's GEMM for one row, oneDNN's over the blocked weight for more, the same
numbers to rounding either way, the blocked layout made once: at construction, or on the
first pass of more than one row when lazy."""

import torch
from torch.nn import functional

from pdchat.core.generation.projection import RowGemm


def _weight_and_rows(rows: int, out: int = 96, inputs: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randn(out, inputs, generator=generator), torch.randn(rows, inputs, generator=generator)


def test_one_row_is_torchs_gemm_and_a_lazy_one_makes_no_blocked_layout():
    weight, x = _weight_and_rows(1)
    gemm = RowGemm(weight, lazy=True)
    assert torch.equal(gemm(x), functional.linear(x, weight))
    assert gemm._layout is None  # a stage that only ever projects one row holds no second copy
    assert RowGemm(weight)._layout is not None  # not lazy: made with it, the memory taken at load


def test_more_rows_run_on_the_blocked_layout_made_once_and_agree_to_rounding():
    weight, x = _weight_and_rows(37)
    gemm = RowGemm(weight, lazy=True)
    first = gemm(x.view(1, 37, -1))  # any leading shape: [rows, queries, in] as prefill passes it
    layout = gemm._layout
    assert layout is not None and first.shape == (1, 37, 96)
    torch.testing.assert_close(first[0], functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(gemm(x), first[0]) and gemm._layout is layout


def test_unblocked_and_non_fp32_weights_keep_torchs_gemm():
    weight, x = _weight_and_rows(5)
    assert torch.equal(RowGemm(weight, blocked=False)(x), functional.linear(x, weight))
    half = RowGemm(weight.bfloat16())
    assert not half.blocked
    assert torch.equal(half(x.bfloat16()), functional.linear(x.bfloat16(), weight.bfloat16()))


def test_the_stored_transpose_serves_one_row():
    weight, x = _weight_and_rows(1)
    gemm = RowGemm(weight, transposed_for_one_row=True)
    assert torch.equal(gemm(x), x @ weight.t().contiguous())
    assert gemm(x.view(1, 1, -1)).shape == (1, 1, 96)


def test_strided_inputs_project_like_contiguous_ones():
    weight, x = _weight_and_rows(12)
    half = torch.cat((x, x), dim=1)[:, :64]  # a slice with a row stride of 128, as a stacked output is read
    gemm = RowGemm(weight)
    torch.testing.assert_close(gemm(half), gemm(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gemm(half), functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_prompts_rows_are_bucketed_and_the_padding_dropped():
    weight, x = _weight_and_rows(37)
    gemm = RowGemm(weight)
    bucketed = gemm(x.view(1, 37, -1), bucket_rows=True)  # computed as 48 rows
    assert bucketed.shape == (1, 37, 96) and bucketed.is_contiguous()
    torch.testing.assert_close(bucketed[0], functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bucketed, gemm(x.view(1, 37, -1)), rtol=1e-6, atol=1e-6)
