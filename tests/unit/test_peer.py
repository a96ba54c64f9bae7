"""`bench peer`'s plan: which prompts each measured run draws, and the systems' order per round."""

import numpy as np

from pdchat.clients.peer import WARM_SEED, paired_ratios, prompt_seed, round_order, schedule


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


def test_the_runs_compared_follow_each_other_and_every_system_gets_every_run():
    runs = schedule(["vllm", "pdchat", "pdchat-pd"], [1, 16], 2)
    assert runs[:3] == [(0, 1, "vllm"), (0, 1, "pdchat"), (0, 1, "pdchat-pd")]
    assert runs[3:6] == [(0, 16, "vllm"), (0, 16, "pdchat"), (0, 16, "pdchat-pd")]
    assert [name for _, _, name in runs[6:9]] == ["pdchat", "pdchat-pd", "vllm"]  # turned by one
    assert sorted(runs) == sorted({(r, c, s) for r in (0, 1) for c in (1, 16) for s in ("vllm", "pdchat", "pdchat-pd")})


def test_paired_ratios_compare_each_round_with_the_vllm_run_beside_it():
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms")
    ours = {"rounds": [dict.fromkeys(keys, 90.0), dict.fromkeys(keys, 200.0), dict.fromkeys(keys, 110.0)]}
    theirs = {"rounds": [dict.fromkeys(keys, 100.0), dict.fromkeys(keys, 100.0), dict.fromkeys(keys, 100.0)]}
    ratios = paired_ratios(ours, theirs)
    assert ratios["output_tok_s"]["rounds"] == [0.9, 2.0, 1.1]
    assert ratios["ttft_p50_ms"]["median"] == 1.1
