"""`bench peer`'s plan: which prompts each measured run draws, and the systems' order per round."""

import numpy as np

from pdchat.clients.peer import WARM_SEED, prompt_seed, round_order


def _offsets(seed: int, prompts: int, vocab: int = 49152) -> list[int]:
    """What `vllm bench serve`'s random dataset draws to place each prompt's tokens
    (vllm/benchmarks/datasets/utils.py, get_sampling_params, fixed lengths): its prompt i
    is the same for a seed whatever the number of prompts."""
    rng = np.random.default_rng(seed)
    rng.integers(256, 257, size=prompts)  # input lengths (one value: draws nothing)
    rng.integers(64, 65, size=prompts)  # output lengths
    return rng.integers(0, vocab, size=prompts).tolist()


def test_one_seed_repeats_its_prompts_across_runs_so_each_run_needs_its_own():
    assert _offsets(1, 16)[:4] == _offsets(1, 4)  # why a seed per run: a shared one repeats prompts


def test_no_measured_run_draws_the_warm_up_or_another_runs_prompts():
    seeds = [prompt_seed(round_, c) for round_ in range(5) for c in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert len(set(seeds)) == len(seeds)
    assert WARM_SEED not in seeds
    drawn = [set(_offsets(seed, 8)) for seed in [WARM_SEED, *seeds[:12]]]
    for i, first in enumerate(drawn):
        for second in drawn[i + 1 :]:
            assert len(first & second) <= 1  # chance only: 8 of 49,152 offsets each


def test_each_system_runs_first_once_over_as_many_rounds_as_systems():
    systems = ["vllm", "pdchat", "pdchat-pd"]
    orders = [round_order(systems, round_) for round_ in range(3)]
    assert all(sorted(order) == sorted(systems) for order in orders)
    assert [order[0] for order in orders] == systems
    assert [order[-1] for order in orders] == ["pdchat-pd", "vllm", "pdchat"]
    assert round_order(systems, 3) == systems
