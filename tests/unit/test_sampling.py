"""Token choice: seeded sampling, and each request field changing the choice as specified."""

import torch

from pdchat.core.generation.sampling import (
    LogitsShaper,
    TokenChooser,
    apply_frequency_presence,
    apply_repetition_penalty,
    choose_token,
    token_logprobs,
)
from pdchat.core.request.protocol import GenerationParams

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


# Shaping and choice per request: each field changes the choice as specified.

EOS = 4
VOCAB = len(LOGITS)


def shaper(prompt=(3,), stop_ids=frozenset({EOS}), **options):
    return LogitsShaper(GenerationParams(max_tokens=8, **options), list(prompt), VOCAB, stop_ids)


def greedy(shaped):
    return choose_token(shaped, temperature=0.0, top_p=1.0, seed=0, position=0)


def test_nothing_asked_costs_nothing():
    plain = shaper()
    assert not plain.active and plain.shape(LOGITS) is LOGITS


def test_presence_penalty_counts_whether_a_token_was_output():
    penalised = shaper(presence_penalty=0.5)
    assert greedy(penalised.shape(LOGITS)) == 1
    penalised.record(1)
    penalised.record(1)
    shaped = penalised.shape(LOGITS)
    assert torch.isclose(shaped[1], torch.tensor(1.5)) and greedy(shaped) == 2  # once, however many times
    assert torch.equal(shaped[[0, 2, 3, 4]], LOGITS[[0, 2, 3, 4]])


def test_frequency_penalty_counts_how_often_and_negative_values_encourage():
    penalised = shaper(frequency_penalty=0.06)
    penalised.record(1)
    assert greedy(penalised.shape(LOGITS)) == 1  # 2.0 - 0.06 > 1.9
    penalised.record(1)
    assert greedy(penalised.shape(LOGITS)) == 2  # 2.0 - 0.12 < 1.9
    encouraged = shaper(frequency_penalty=-0.2)
    encouraged.record(2)
    assert greedy(encouraged.shape(LOGITS)) == 2


def test_repetition_penalty_covers_prompt_and_output_and_divides_or_multiplies():
    assert greedy(shaper(prompt=[1], repetition_penalty=1.1).shape(LOGITS)) == 2  # in the prompt: 2.0 / 1.1 < 1.9
    later = shaper(prompt=[0], repetition_penalty=1.1)
    assert greedy(later.shape(LOGITS)) == 1
    later.record(1)
    assert greedy(later.shape(LOGITS)) == 2  # and in the output
    logits = torch.tensor([2.0, -1.0, 3.0])
    apply_repetition_penalty(logits, torch.tensor([True, True, False]), 2.0)
    assert logits.tolist() == [1.0, -2.0, 3.0]


def test_frequency_presence_arithmetic():
    logits = torch.zeros(3)
    apply_frequency_presence(logits, torch.tensor([0.0, 1.0, 3.0]), 0.5, 0.25)
    assert logits.tolist() == [0.0, -0.75, -1.75]


def test_logit_bias_bans_the_likeliest_token_and_forces_an_unlikely_one():
    assert greedy(shaper(logit_bias={"1": -100.0}).shape(LOGITS)) == 2
    forced = shaper(logit_bias={"3": 100.0}).shape(LOGITS)
    assert {choose_token(forced, temperature=1.0, top_p=1.0, seed=s, position=0) for s in range(30)} == {3}


def test_min_tokens_suppresses_stop_tokens_until_reached():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0, 5.0])  # EOS (4) likeliest
    waiting = shaper(min_tokens=2, stop_ids=frozenset({EOS, 2}))
    assert greedy(waiting.shape(logits)) == 1
    waiting.record(1)
    shaped = waiting.shape(logits)
    assert shaped[EOS] == float("-inf") and shaped[2] == float("-inf")  # stop_token_ids too
    waiting.record(0)
    assert greedy(waiting.shape(logits)) == EOS


def test_min_tokens_yields_when_a_grammar_allows_only_a_stop_token():
    only_eos = torch.full((VOCAB,), float("-inf"))
    only_eos[EOS] = 0.0
    assert greedy(shaper(min_tokens=3).shape(only_eos)) == EOS


def test_top_k_one_is_greedy_and_top_k_keeps_the_k_likeliest():
    assert {
        choose_token(LOGITS, temperature=1.5, top_p=1.0, top_k=1, seed=s, position=p)
        for s in range(20)
        for p in range(3)
    } == {1}
    assert {choose_token(LOGITS, temperature=1.5, top_p=1.0, top_k=2, seed=s, position=0) for s in range(60)} == {1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_likeliest():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.0])
    assert {choose_token(logits, temperature=1.0, top_p=1.0, seed=s, position=0) for s in range(200)} == {0, 1, 2, 3}
    assert {choose_token(logits, temperature=1.0, top_p=1.0, min_p=0.5, seed=s, position=0) for s in range(200)} == {
        0,
        1,
    }


def test_top_p_measures_the_mass_left_after_top_k():
    logits = torch.tensor([2.0, 1.99, 1.98, 1.97, 1.96])
    # Alone, top_p 0.5 keeps 3 of 5 near-equal tokens; after top_k=2 the likeliest holds over half of what is left.
    assert len({choose_token(logits, temperature=1.0, top_p=0.5, seed=s, position=0) for s in range(100)}) == 3
    assert len({choose_token(logits, temperature=1.0, top_p=0.5, top_k=2, seed=s, position=0) for s in range(100)}) == 1


def test_logprobs_are_the_raw_distribution_with_the_likeliest_first():
    entry = token_logprobs(LOGITS, 2, 3)
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert entry.token_id == 2 and entry.logprob == float(raw[2])
    assert [t for t, _ in entry.top] == [1, 2, 4] and entry.top[0][1] == float(raw[1])
    assert token_logprobs(LOGITS, 2, 0).top == ()


def test_chooser_logprobs_ignore_temperature_penalties_and_biases_and_state_follows_replay():
    params = GenerationParams(
        max_tokens=8, temperature=0.0, logit_bias={"3": 100.0}, presence_penalty=1.0, logprobs=True, top_logprobs=2
    )
    chooser = TokenChooser(params, LogitsShaper(params, [0], VOCAB, frozenset({EOS})), None)
    choice = chooser.choose(LOGITS)
    assert choice.token_id == 3
    assert choice.logprobs.logprob == float(torch.log_softmax(LOGITS, dim=-1)[3])
    assert [t for t, _ in choice.logprobs.top] == [1, 2]
    replayed = TokenChooser(params, LogitsShaper(params, [0], VOCAB, frozenset({EOS})), None)
    replayed.replay(3)
    assert chooser.choose(LOGITS) == replayed.choose(LOGITS)  # position and penalties continue alike
    plain = GenerationParams(max_tokens=8, temperature=0.0)
    assert TokenChooser(plain, LogitsShaper(plain, [0], VOCAB, frozenset()), None).choose(LOGITS).logprobs is None


def test_only_a_plain_greedy_chooser_takes_the_batchs_argmax():
    """A batched step hands each row the argmax it computed once; a chooser with anything
    more to do (bias, logprobs, sampling) ignores it and chooses as it would alone."""

    def chooser(**options):
        params = GenerationParams(max_tokens=8, **options)
        return TokenChooser(params, LogitsShaper(params, [0], VOCAB, frozenset({EOS})), None)

    batch_argmax = int(LOGITS.argmax())
    plain = chooser(temperature=0.0)
    assert plain.greedy and plain.choose(LOGITS, batch_argmax) == chooser(temperature=0.0).choose(LOGITS)
    for options in ({"logit_bias": {"3": 100.0}}, {"logprobs": True}, {"temperature": 1.0, "seed": 5}):
        busy = chooser(**{"temperature": 0.0, **options})
        assert not busy.greedy
        assert busy.choose(LOGITS, batch_argmax) == chooser(**{"temperature": 0.0, **options}).choose(LOGITS)


def test_top_k_one_and_a_satisfied_min_tokens_take_the_greedy_path():
    """Issue 56: top_k=1 never reached the greedy head, and a request with min_tokens stayed
    off it for its whole answer. top_k=1 is greedy whatever the temperature; min_tokens keeps
    a row off the greedy path only until that many tokens are out."""

    def chooser(**options):
        params = GenerationParams(max_tokens=8, **options)
        return TokenChooser(params, LogitsShaper(params, [0], VOCAB, frozenset({EOS})), None)

    assert chooser(temperature=1.3, top_k=1, seed=4).greedy
    assert not chooser(temperature=1.3, top_k=2, seed=4).greedy
    waiting = chooser(temperature=0.0, min_tokens=2)
    assert not waiting.greedy
    waiting.choose(LOGITS)
    assert not waiting.greedy
    waiting.choose(LOGITS)
    assert waiting.greedy, "two tokens are out: nothing shapes the logits any more"
    assert not chooser(temperature=0.0, min_tokens=2, logit_bias={"3": 1.0}).greedy


def test_draws_follow_the_kept_distribution():
    """The inverse-transform draw: over many seeds each token comes as often as its share of
    what temperature and top_p keep (here top_p 0.8 keeps the three likeliest: 0.77 < 0.8)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = [choose_token(logits, temperature=1.0, top_p=0.8, seed=s, position=1) for s in range(8000)]
    kept = torch.softmax(logits, -1)[:3]
    expected = (kept / kept.sum()).tolist() + [0.0, 0.0]
    for token, share in enumerate(expected):
        assert abs(draws.count(token) / len(draws) - share) < 0.02, (token, draws.count(token), share)
