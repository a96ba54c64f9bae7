"""Seals on stage inputs: what this server's renderer, prefill or chat sealed opens a stage,
once, until it expires; nothing else does."""

import os
import stat
import subprocess
import sys
import time

import pytest

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.request.protocol import GenerationParams
from pdchat.ensemble import seal as seal_module
from pdchat.ensemble.seal import NonceLedger, SealRefusal, StageSeal, Unsealed, server_directory, server_id

IDS = [5, 6, 7]
PARAMS = GenerationParams(max_tokens=4).to_json()
KEY = b"k" * 32


@pytest.fixture
def seal(tmp_path):
    return StageSeal(KEY, tmp_path / "nonces")


def refused(check) -> Unsealed:
    with pytest.raises(Unsealed, match="stage models take only input sealed by this server's renderer") as info:
        check()
    return info.value


def test_a_sealed_prompt_opens_the_stage_and_any_change_closes_it(seal, tmp_path):
    token = seal.seal_prompt(IDS, PARAMS)
    other_server = StageSeal(b"other-key-000000", tmp_path / "other")
    for ids, params, handle, given, reason in [
        (IDS[:-1] + [8], PARAMS, "", token, SealRefusal.ALTERED),
        (IDS, PARAMS.replace('"max_tokens": 4', '"max_tokens": 5'), "", token, SealRefusal.ALTERED),
        (IDS, PARAMS, '{"connector": "shm"}', token, SealRefusal.ALTERED),  # a KV handle needs its own seal
        (IDS, PARAMS, "", token[:-1] + ("0" if token[-1] != "0" else "1"), SealRefusal.ALTERED),
        (IDS, PARAMS, "", None, SealRefusal.UNSEALED),
        (IDS, PARAMS, "", "é" * 64, SealRefusal.MALFORMED),
        (IDS, PARAMS, "", "0" * 64, SealRefusal.MALFORMED),  # a seal of the old form
        (IDS, PARAMS, "", other_server.seal_prompt(IDS, PARAMS), SealRefusal.NOT_THIS_SERVER),
    ]:
        error = refused(
            lambda ids=ids, params=params, handle=handle, given=given: seal.check_prompt(ids, params, handle, given)
        )
        assert error.reason is reason and f"({reason.value}: " in str(error)
    seal.check_prompt(IDS, PARAMS, "", token)  # the refusals claimed nothing


def test_request_prompt_and_cancel_seals_are_not_interchangeable(seal):
    assert refused(lambda: seal.check_cancel("r1", seal.seal_request("r1"))).reason is SealRefusal.ALTERED
    assert refused(lambda: seal.check_request("{}", seal.seal_cancel("{}"))).reason is SealRefusal.ALTERED
    seal.check_cancel("r1", seal.seal_cancel("r1"))
    assert "a cancellation refused (unsealed" in str(refused(lambda: seal.check_cancel("r1", None)))
    assert issubclass(Unsealed, InvalidRequest)  # INVALID_ARG for the client


def test_a_feed_grant_opens_the_feed_it_names_once(seal):
    grant = seal.seal_feed("feed-a")
    assert refused(lambda: seal.check_feed("feed-b", grant)).reason is SealRefusal.ALTERED
    assert refused(lambda: seal.check_feed("feed-a", seal.seal_cancel("feed-a"))).reason is SealRefusal.ALTERED
    assert "a decode feed refused (unsealed" in str(refused(lambda: seal.check_feed("feed-a", None)))
    assert refused(lambda: seal.check_feed("feed-a", "")).reason is SealRefusal.MALFORMED  # the red team's empty seal
    seal.check_feed("feed-a", grant)
    assert refused(lambda: seal.check_feed("feed-a", grant)).reason is SealRefusal.REPLAYED


def test_a_prompt_seal_opens_one_stage_call_in_any_process_of_the_server(seal, tmp_path):
    token = seal.seal_prompt(IDS, PARAMS, "handle")
    seal.check_prompt(IDS, PARAMS, "handle", token)
    error = refused(lambda: seal.check_prompt(IDS, PARAMS, "handle", token))
    assert error.reason is SealRefusal.REPLAYED and "(replayed: " in str(error)
    another_instance = StageSeal(KEY, tmp_path / "nonces")  # prefill's other instance: its own process
    assert refused(lambda: another_instance.check_prompt(IDS, PARAMS, "handle", token)).reason is SealRefusal.REPLAYED
    another_instance.check_prompt(IDS, PARAMS, "handle", seal.seal_prompt(IDS, PARAMS, "handle"))  # a fresh seal
    request = seal.seal_request("{}")
    seal.check_request("{}", request)
    seal.check_request("{}", request)  # the renderer allocates no KV: not single-use


def test_a_seal_expires(tmp_path):
    brief = StageSeal(KEY, tmp_path / "nonces", ttl_s=0.05)
    token, cancel = brief.seal_prompt(IDS, PARAMS), brief.seal_cancel("r")
    time.sleep(0.1)
    error = refused(lambda: brief.check_prompt(IDS, PARAMS, "", token))
    assert error.reason is SealRefusal.EXPIRED and "(setting stage_seal_ttl_s)" in str(error)
    assert refused(lambda: brief.check_cancel("r", cancel)).reason is SealRefusal.EXPIRED


def test_the_ledger_forgets_a_nonce_once_its_seal_expired(tmp_path):
    ledger = NonceLedger(tmp_path)
    nonce = "ab" * 16
    assert ledger.claim(nonce, 1_000_500, now=999.0) and not ledger.claim(nonce, 1_000_500, now=999.5)
    assert ledger.claim("cd" * 16, 1_003_000, now=1002.0)  # the sweep at 1002 s removes the bucket of 1000 s
    assert sorted(os.listdir(tmp_path)) == ["1003"]


STUB = "from pdchat.ensemble.seal import StageSeal; print(StageSeal.for_this_server({}).key_id)"
SERVER = f"""
import subprocess, sys
stubs = [subprocess.Popen([sys.executable, "-c", {STUB!r}], stdout=subprocess.PIPE, text=True) for _ in range(3)]
print(" ".join(stub.communicate()[0].strip() for stub in stubs))
"""


def test_each_server_has_a_key_of_its_own_that_all_its_models_share(tmp_path):
    """Two servers (processes whose children are their stage models): the models of one
    agree on one key, made by whichever came first; the other server's differs."""
    env = {**os.environ, "PDCHAT_CACHE_DIR": str(tmp_path)}
    env.pop("PDCHAT_STAGE_KEY", None)
    servers = [
        subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=env) for _ in "ab"
    ]
    key_ids = [set(server.communicate(timeout=60)[0].split()) for server in servers]
    assert [len(ids) for ids in key_ids] == [1, 1] and key_ids[0] != key_ids[1]
    # Both servers are gone: the next server's key removes what they left.
    subprocess.run([sys.executable, "-c", SERVER], env=env, check=True, capture_output=True)
    assert len(os.listdir(tmp_path / "stage")) == 1


def test_a_server_that_starts_while_another_sweeps_keeps_its_key(tmp_path, monkeypatch):
    """The sweep of gone servers' directories, racing a server that starts meanwhile: the
    new server's directory (made after the sweep listed the old ones) stays, key and all."""
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_directory = server_directory(gone.pid)
    gone.wait()
    real_alive, started = seal_module.procfs.alive, []

    def a_server_starts_meanwhile(pid: int) -> bool:  # once, at the sweep's first check
        monkeypatch.setattr(seal_module.procfs, "alive", real_alive)
        started.append(StageSeal.for_this_server({}).key_id)  # this process's parent: its server
        return real_alive(pid)

    monkeypatch.setattr(seal_module.procfs, "alive", a_server_starts_meanwhile)
    seal_module._remove_gone_servers(tmp_path / "stage")
    assert not gone_directory.exists() and started
    assert StageSeal.for_this_server({}).key_id == started[0]


def test_the_key_file_is_private_and_read_by_tools_of_the_same_user(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    models = StageSeal.for_this_server({})
    directory = server_directory(os.getppid())
    assert directory.name == server_id(os.getppid()) and directory.parent == tmp_path / "stage"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "key").stat().st_mode) == 0o600
    tool = StageSeal.of_server(os.getppid())
    models.check_prompt(IDS, PARAMS, "", tool.seal_prompt(IDS, PARAMS))
    explicit = StageSeal.for_this_server({"PDCHAT_STAGE_KEY": "s" * 32})
    assert explicit.key_id != models.key_id
    os.chmod(directory / "key", 0o644)
    with pytest.raises(ModelUnavailable, match="mode 0600"):
        StageSeal.for_this_server({})
    with pytest.raises(ModelUnavailable, match="has no stage key"):
        StageSeal.of_server(os.getpid())


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
