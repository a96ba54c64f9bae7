"""GreedyHead: the greedy token from the hidden state through a screen of the vocabulary
projection (bf16 or int8, whichever this host's build has), decided exactly: the argmax of
the exact logits on every row, whatever rows are beside it, the first on a tie; rows it cannot decide come back -1 and the engine's step then
projects them in full; wrong tensors are refused before C reads them."""

import pytest
import torch

from pdchat.core.generation import cpu_kernels
from pdchat.core.generation.engine import CausalLM, DecodeBatch, PromptPrefill

VOCAB, WIDTH = 4096, 96


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    loaded = cpu_kernels.load(tmp_path_factory.mktemp("kernels"))
    if loaded is None or not loaded.head_screens:
        pytest.skip(
            "no C compiler, or a CPU with neither AVX-512 BF16 nor AVX2 and FMA, on this host: the screen is optional"
        )
    return loaded


# The head's ways to a token, each forced at every row count: a screen, or fp32's projection.
WAYS = ("int8", "bf16", "fp32")


@pytest.fixture(params=WAYS)
def way(request, kernels):
    if request.param != "fp32" and request.param not in kernels.head_screens:
        pytest.skip(f"this host's build has no {request.param} screen")
    return request.param


def _head(kernels, weight, way, **options):
    return cpu_kernels.GreedyHead(kernels, weight, way=way, **options)


def _weight(seed=0, vocab=VOCAB, width=WIDTH):
    return torch.randn(vocab, width, generator=torch.Generator().manual_seed(seed)) * 0.05


def _exact_argmax(hidden, weight):
    return (hidden.double() @ weight.double().t()).argmax(-1).tolist()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16, 29])  # every tile size (AVX-512 and AVX2), tiles side by side
def test_the_token_is_the_exact_logits_argmax_on_every_row(kernels, way, rows):
    weight = _weight()
    hidden = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))
    tokens = _head(kernels, weight, way).argmax(hidden)
    assert tokens == _exact_argmax(hidden, weight)
    assert tokens == (hidden @ weight.t()).argmax(-1).tolist()  # and fp32's, away from ties


def test_a_rows_token_does_not_depend_on_the_rows_beside_it(kernels, way):
    head = _head(kernels, _weight(), way)
    hidden = torch.randn(21, WIDTH, generator=torch.Generator().manual_seed(1))
    assert head.argmax(hidden) == [head.argmax(hidden[row : row + 1])[0] for row in range(21)]


@pytest.mark.parametrize("rows", [1, 29])
def test_split_over_threads_the_screen_gives_the_same_tokens(kernels, way, rows):
    """A pass that took more threads splits the screen's vocabulary blocks over them."""
    weight = _weight()
    head = _head(kernels, weight, way)
    hidden = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(9))
    alone = head.argmax(hidden)
    try:
        kernels.set_threads(2)
        assert head.argmax(hidden) == alone == _exact_argmax(hidden, weight)
    finally:
        kernels.set_threads(1)


def test_a_tie_closer_than_the_screen_can_tell_is_decided_exactly_the_first_index_winning(kernels, way):
    weight = _weight()
    weight[700] = weight[3000]  # an exact tie, and a near one the screen rounds to the same value
    weight[1200] = weight[3000] * (1 - 1e-6)
    hidden = (weight[3000] * 40).view(1, -1)
    assert _head(kernels, weight, way).argmax(hidden) == [700]
    weight[1200] = weight[3000] * (1 + 1e-6)  # now the near one is the larger, by less than the screen's step
    assert _head(kernels, weight, way).argmax(hidden) == [1200]


def test_hidden_states_and_weights_far_from_uniform_are_decided_exactly(kernels, way):
    # What quantizing by a row's largest value handles worst: one outlier per hidden state
    # (a real model's final norm has some), vocabulary rows of very different scales, rows of zeros.
    weight = _weight(seed=5)
    weight[::7] *= 30
    weight[::11] *= 1e-3
    weight[100:108] = 0
    hidden = torch.randn(12, WIDTH, generator=torch.Generator().manual_seed(6))
    hidden[:, 3] *= 50
    hidden[5] *= 1e6
    tokens = _head(kernels, weight, way).argmax(hidden)
    exact = _exact_argmax(hidden, weight)
    assert all(token in (-1, best) for token, best in zip(tokens, exact, strict=True))
    assert tokens.count(-1) <= 2, "an outlier widens the bound, but seldom past the candidates' limit"
    tiny, huge = torch.randn(1, WIDTH) * 2.0**-40, torch.randn(1, WIDTH) * 2.0**40
    for row in (tiny, huge):  # out of the int8 screen's range: undecided, never wrong
        assert _head(kernels, weight, way).argmax(row)[0] in (-1, _exact_argmax(row, weight)[0])


def test_rows_it_cannot_decide_come_back_undecided(kernels, way):
    weight = _weight()
    weight[10] = weight[20]
    tied = (weight[20] * 40).view(1, -1)
    assert _head(kernels, weight, way, max_candidates=1).argmax(tied) == [-1]  # two candidates
    broken = torch.randn(3, WIDTH)
    broken[1, 5] = float("nan")
    assert _head(kernels, weight, way).argmax(broken) == [-1, -1, -1]  # not bounded: all go in full


def test_tensors_it_does_not_compute_are_refused_not_read(kernels, way):
    head = _head(kernels, _weight(), way)
    for hidden in (torch.randn(2, WIDTH + 2), torch.randn(2, WIDTH, dtype=torch.float64), torch.randn(WIDTH)):
        with pytest.raises(ValueError):
            head.argmax(hidden)
    assert not cpu_kernels.GreedyHead.fits(kernels, _weight(vocab=VOCAB + 4))  # vocabulary not in blocks of 8 or 16
    assert not cpu_kernels.GreedyHead.fits(kernels, _weight(width=WIDTH + 1))  # odd width
    if kernels.head_screens == ("int8",):  # each row's scale and products kept normal floats
        assert not cpu_kernels.GreedyHead.fits(kernels, _weight() * 2.0**-64)
        assert not cpu_kernels.GreedyHead.fits(kernels, _weight() * 2.0**40)
    assert not cpu_kernels.GreedyHead.fits(None, _weight())
    assert cpu_kernels.GreedyHead.fits(kernels, _weight())


def test_a_step_of_greedy_and_sampling_rows_gives_what_a_full_step_does(tiny_model_dir, kernels):
    engine = CausalLM(tiny_model_dir, "cpu")
    engine.decode_kernels = kernels
    prompts = [[5, 6, 7, 8], [9] * 30, [11, 12], list(range(100, 140))]
    batches, firsts = [], []
    for _ in range(2):  # the same rows twice: one stepped in full, one by rows
        batch = DecodeBatch(engine)
        for prompt in prompts:
            logits, sequence = engine.prefill(prompt)
            batch.join(sequence)
            firsts.append(int(logits.argmax()))
        batches.append(batch)
    ids = firsts[: len(prompts)]
    greedy = [True, False, True, True]
    full = batches[0].step(ids)
    rows, tokens = batches[1].step_rows(ids, greedy)
    assert engine._greedy_head() is not None, "the screen serves the tiny model here"
    assert tokens == [int(full[row].argmax()) if greedy[row] else None for row in range(len(prompts))]
    assert rows[0] is None and rows[2] is None and rows[3] is None  # decided without their logits
    torch.testing.assert_close(rows[1], full[1], rtol=1e-4, atol=1e-4)


def test_a_greedy_prompts_first_token_comes_from_its_last_prefill_chunk_without_logits(tiny_model_dir, kernels):
    engine = CausalLM(tiny_model_dir, "cpu")
    engine.decode_kernels = kernels
    for prompt in ([5, 6, 7, 8], list(range(100, 170))):
        full, sequence = engine.prefill(prompt, cache_salt="full")
        sequence.release()
        chunked = PromptPrefill(engine, prompt, cache_salt="greedy", chunk=32)  # salts: no shared prefix
        while (last := chunked.step(greedy=True)) is None:
            assert chunked.remaining > 0
        chunked.release()
        assert last == (None, int(full.argmax()))  # decided without the logits
        sampled = PromptPrefill(engine, prompt, cache_salt="sampled", chunk=len(prompt))
        logits, token = sampled.step(greedy=False)
        sampled.release()
        assert token is None
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def test_every_way_gives_the_same_exact_tokens_whichever_the_timing_picks(kernels):
    weight = _weight(seed=3)
    hidden = torch.randn(40, WIDTH, generator=torch.Generator().manual_seed(4))
    ways = [way for way in WAYS if way == "fp32" or way in kernels.head_screens]
    tokens = [_head(kernels, weight, way).argmax(hidden) for way in ways]
    assert all(each == _exact_argmax(hidden, weight) for each in tokens)
    timed = cpu_kernels.GreedyHead(kernels, weight)  # times every way on a bucket's first batch
    assert timed.ways == {}  # nothing timed yet
    assert timed.argmax(hidden) == tokens[0]  # 40 rows: the last bucket, timed now
    assert timed.argmax(hidden[:3]) == tokens[0][:3]  # the 4-row bucket
    assert set(timed.ways) == {4, 32} and set(timed.ways.values()) <= set(ways)


def test_a_screen_that_leaves_every_row_undecided_loses_the_timing(kernels):
    # Logits closer together than a screen's bound but not fp32's: the screens leave every
    # row undecided (the full projection follows), fp32's projection decides them all.
    vocab = 16384
    base = _weight(seed=7, vocab=1)
    weight = base * (1 + 1e-4 * torch.arange(vocab, dtype=torch.float32)[:, None])
    hidden = base.repeat(16, 1) * (1 + 0.01 * torch.arange(16, dtype=torch.float32)[:, None])
    timed = cpu_kernels.GreedyHead(kernels, weight)
    assert timed.argmax(hidden) == _exact_argmax(hidden, weight) == [vocab - 1] * 16
    assert all(
        each == [-1] * 16 for each in (_head(kernels, weight, way).argmax(hidden) for way in kernels.head_screens)
    )
    assert timed.ways[16] == "fp32"
