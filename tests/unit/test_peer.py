"""`bench peer`'s plan: which prompts each measured run draws, and the systems' order per round."""

from argparse import Namespace

import numpy as np
import pytest

from benchmarks.peer import (
    WARM_SEED,
    max_model_len,
    paired_ratios,
    peer_of,
    prompt_seed,
    round_order,
    schedule,
    wait_for_quiet_host,
)
from benchmarks.vllm_pd_proxy import prefill_body


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


def test_rounds_turn_the_order_and_no_system_follows_the_same_one_twice_running():
    systems = ["vllm", "pdchat", "pdchat-pd", "pdchat-prefill"]
    orders = [round_order(systems, round_) for round_ in range(4)]
    assert all(sorted(order) == sorted(systems) for order in orders)
    assert orders[0] == systems and orders[1] == ["vllm", "pdchat-prefill", "pdchat-pd", "pdchat"]

    def predecessor(order: list[str], name: str) -> str | None:
        return order[order.index(name) - 1] if order.index(name) else None

    for first, second in zip(orders, orders[1:], strict=False):
        for name in systems:
            if predecessor(first, name) is not None:
                assert predecessor(first, name) != predecessor(second, name), (name, first, second)


def test_a_run_waits_until_the_cpus_were_quiet_over_a_window():
    now = [0.0]
    busy_cores = iter([1.0, 0.5, 0.1, 0.0])  # over each window, on a one-CPU host
    ticks = {"busy": 0, "idle": 0}

    def read() -> str:
        return f"cpu0 {ticks['busy']} 0 0 {ticks['idle']} 0 0 0 0\n"

    def sleep(seconds: float) -> None:
        now[0] += seconds
        cores = next(busy_cores)
        ticks["busy"] += round(100 * seconds * cores)
        ticks["idle"] += round(100 * seconds * (1 - cores))

    waited = wait_for_quiet_host(0.25, window_s=0.2, read=read, cpus=[0], clock=lambda: now[0], sleep=sleep)
    assert waited == pytest.approx(0.6)  # the third window was quiet


def test_the_runs_compared_follow_each_other_and_every_system_gets_every_run():
    runs = schedule(["vllm", "pdchat", "pdchat-pd"], [1, 16], 2)
    assert runs[:3] == [(0, 1, "vllm"), (0, 1, "pdchat"), (0, 1, "pdchat-pd")]
    assert runs[3:6] == [(0, 16, "vllm"), (0, 16, "pdchat"), (0, 16, "pdchat-pd")]
    assert [name for _, _, name in runs[6:9]] == ["vllm", "pdchat-pd", "pdchat"]  # turned by one, backwards
    assert sorted(runs) == sorted({(r, c, s) for r in (0, 1) for c in (1, 16) for s in ("vllm", "pdchat", "pdchat-pd")})


def test_paired_ratios_compare_each_round_with_the_vllm_run_beside_it():
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms")
    ours = {"rounds": [dict.fromkeys(keys, 90.0), dict.fromkeys(keys, 200.0), dict.fromkeys(keys, 110.0)]}
    theirs = {"rounds": [dict.fromkeys(keys, 100.0), dict.fromkeys(keys, 100.0), dict.fromkeys(keys, 100.0)]}
    ratios = paired_ratios(ours, theirs)
    assert ratios["output_tok_s"]["rounds"] == [0.9, 2.0, 1.1]
    assert ratios["ttft_p50_ms"]["median"] == 1.1


def test_p_d_systems_are_compared_with_vllms_own_p_d_where_it_ran():
    both = ["vllm", "vllm-pd", "pdchat", "pdchat-pd", "pdchat-vllm-pd"]
    assert [peer_of(name, both) for name in both] == [None, "vllm", "vllm", "vllm-pd", "vllm-pd"]
    assert peer_of("pdchat-vllm-pd", ["vllm", "pdchat-vllm-pd"]) == "vllm"


def test_the_context_fits_the_runs_prompts_and_answers():
    assert max_model_len(Namespace(input_tokens=256, output_tokens=64)) == 4096
    assert max_model_len(Namespace(input_tokens=16000, output_tokens=32)) >= 16032


def test_vllms_p_d_proxy_asks_prefill_for_one_unstreamed_token_and_its_kv_kept():
    body = {"model": "m", "messages": [], "max_completion_tokens": 64, "stream": True, "stream_options": {}}
    leg = prefill_body(body)
    assert leg == {
        "model": "m",
        "messages": [],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["stream"] is True  # the decode leg is the client's request as sent
