"""Seals on stage inputs: what the renderer or chat sealed opens a stage, nothing else."""

import os
import stat

import pytest

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.request.protocol import GenerationParams
from pdchat.ensemble.seal import StageSeal, Unsealed

IDS = [5, 6, 7]
PARAMS = GenerationParams(max_tokens=4).to_json()


def test_a_sealed_prompt_opens_the_stage_and_any_change_closes_it():
    seal = StageSeal(b"k" * 32)
    token = seal.seal_prompt(IDS, PARAMS)
    seal.check_prompt(IDS, PARAMS, "", token)
    for ids, params, handle, given in [
        (IDS[:-1] + [8], PARAMS, "", token),
        (IDS, PARAMS.replace('"max_tokens": 4', '"max_tokens": 5'), "", token),
        (IDS, PARAMS, '{"connector": "shm"}', token),  # a KV handle needs its own seal
        (IDS, PARAMS, "", None),
        (IDS, PARAMS, "", "é" * 64),
        (IDS, PARAMS, "", StageSeal(b"other-key-000000").seal_prompt(IDS, PARAMS)),
    ]:
        with pytest.raises(Unsealed, match="sealed by this server's renderer or chat model"):
            seal.check_prompt(ids, params, handle, given)


def test_request_prompt_and_cancel_seals_are_not_interchangeable():
    seal = StageSeal(b"k" * 32)
    with pytest.raises(Unsealed):
        seal.check_cancel("r1", seal.seal_request("r1"))
    with pytest.raises(Unsealed):
        seal.check_request("{}", seal.seal_cancel("{}"))
    seal.check_cancel("r1", seal.seal_cancel("r1"))
    assert issubclass(Unsealed, InvalidRequest)  # INVALID_ARG for the client


def test_the_key_comes_from_env_the_handoff_key_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    explicit = StageSeal.for_this_server({"PDCHAT_STAGE_KEY": "s" * 32})
    derived = StageSeal.for_this_server({"PDCHAT_HANDOFF_KEY": "h" * 32})
    first, second = StageSeal.for_this_server({}), StageSeal.for_this_server({})
    assert first.seal_cancel("x") == second.seal_cancel("x")  # one key for every model of this user
    assert len({explicit.seal_cancel("x"), derived.seal_cancel("x"), first.seal_cancel("x")}) == 3
    key_file = tmp_path / "stage.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    os.chmod(key_file, 0o644)
    with pytest.raises(ModelUnavailable, match="mode 0600"):
        StageSeal.for_this_server({})


def test_stage_models_check_generation_params_whoever_sent_them():
    GenerationParams(max_tokens=10).check(prompt_tokens=90, context_length=100, vocab_size=50)
    for params, needle in [
        (GenerationParams(max_tokens=11), "exceed this model's context"),
        (GenerationParams(max_tokens=4, temperature=-5.0), "'temperature' must be a number in"),
        (GenerationParams(max_tokens=4, top_p=0.0), "'top_p' must be a number in"),
        (GenerationParams(max_tokens=0), "'max_tokens' must be a positive integer"),
        (GenerationParams(max_tokens=4, seed=-1), "'seed' must be a non-negative"),
        (GenerationParams(max_tokens=4, presence_penalty=3.0), "'presence_penalty' must be a number in"),
        (GenerationParams(max_tokens=4, repetition_penalty=0.0), "'repetition_penalty' must be a number > 0"),
        (GenerationParams(max_tokens=4, logit_bias={"7": 101.0}), r"'logit_bias\[7\]' must be a number in"),
        (GenerationParams(max_tokens=4, logit_bias={"50": 1.0}), "'logit_bias' names token ids outside"),
        (GenerationParams(max_tokens=4, stop_token_ids=(3, 99)), r"'stop_token_ids' names token ids outside .* \[99\]"),
        (GenerationParams(max_tokens=4, min_tokens=5), r"'min_tokens' \(5\) must not exceed max_tokens \(4\)"),
        (GenerationParams(max_tokens=4, top_k=-3), "'top_k' must be"),
        (GenerationParams(max_tokens=4, min_p=1.5), "'min_p' must be a number in"),
        (GenerationParams(max_tokens=4, top_logprobs=21, logprobs=True), "'top_logprobs' must be an integer in"),
        (GenerationParams(max_tokens=4, top_logprobs=2), "'top_logprobs' needs 'logprobs'"),
    ]:
        with pytest.raises(InvalidRequest, match=needle):
            params.check(prompt_tokens=90, context_length=100, vocab_size=50)
