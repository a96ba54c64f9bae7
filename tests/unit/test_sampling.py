import torch

from pdchat.core.generation.sampling import choose_token

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5])


def test_temperature_zero_is_argmax():
    assert choose_token(LOGITS, temperature=0.0, top_p=1.0, seed=1, position=0) == 1


def test_same_seed_and_position_repeat_different_ones_vary():
    picks = [choose_token(LOGITS, temperature=1.5, top_p=1.0, seed=7, position=p) for p in range(40)]
    again = [choose_token(LOGITS, temperature=1.5, top_p=1.0, seed=7, position=p) for p in range(40)]
    other = [choose_token(LOGITS, temperature=1.5, top_p=1.0, seed=8, position=p) for p in range(40)]
    assert picks == again
    assert picks != other
    assert len(set(picks)) > 1


def test_tiny_top_p_keeps_only_the_most_likely_token():
    picks = {choose_token(LOGITS, temperature=1.0, top_p=0.01, seed=s, position=0) for s in range(30)}
    assert picks == {1}


def test_top_p_excludes_the_tail():
    logits = torch.tensor([5.0, 4.9, -5.0, -6.0])
    picks = {choose_token(logits, temperature=1.0, top_p=0.9, seed=s, position=0) for s in range(60)}
    assert picks == {0, 1}
