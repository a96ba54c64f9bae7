"""RowGemm: oneDNN's GEMM over the blocked weight for any rows, each row's result the same
bits alone and in any batch; torch's numbers to rounding; the blocked layout made once, at
construction or on the first pass when lazy; torch's GEMM where oneDNN does not run."""

import torch
from torch.nn import functional

from pdchat.core.generation.projection import RowGemm


def _weight_and_rows(rows: int, out: int = 96, inputs: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randn(out, inputs, generator=generator), torch.randn(rows, inputs, generator=generator)


def test_a_lazy_layout_waits_for_the_first_pass():
    weight, x = _weight_and_rows(1)
    gemm = RowGemm(weight, lazy=True)
    assert gemm._layout is None  # a stage that never projects holds no second copy
    assert RowGemm(weight)._layout is not None  # not lazy: made with it, the memory taken at load
    torch.testing.assert_close(gemm(x), functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert gemm._layout is not None


def test_a_rows_result_is_the_same_bits_alone_and_in_any_batch():
    """The batch invariance: one row (computed as two), any row count, with or without
    the prompt's bucketing, gives each row the same bits, on 1 thread and on 2."""
    weight, x = _weight_and_rows(37, out=200, inputs=1536)  # a K where oneDNN's one-row kernel sums apart
    bias = torch.randn(200, generator=torch.Generator().manual_seed(7))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for gemm in (RowGemm(weight), RowGemm(weight, bias=bias)):
                batch = gemm(x)
                for row in (0, 5, 36):
                    assert torch.equal(gemm(x[row : row + 1]), batch[row : row + 1])
                assert torch.equal(gemm(x[:3]), batch[:3])
                assert torch.equal(gemm(x.view(1, 37, -1), bucket_rows=True)[0], batch)
    finally:
        torch.set_num_threads(threads)


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


def test_the_stored_transpose_serves_one_row_where_onednn_does_not_run():
    weight, x = _weight_and_rows(1)
    gemm = RowGemm(weight, blocked=False, transposed_for_one_row=True)
    assert torch.equal(gemm(x), x @ weight.t().contiguous())
    assert gemm(x.view(1, 1, -1)).shape == (1, 1, 96)
    assert RowGemm(weight, transposed_for_one_row=True)._transposed is None  # oneDNN serves one row


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
