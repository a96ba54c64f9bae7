"""What pdchat asks of vLLM's engine (core.vllm.arguments), without vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdchat.core.errors import ModelUnavailable
from pdchat.core.request.protocol import GenerationParams
from pdchat.core.vllm.arguments import (
    cpu_kv_cache_gib,
    engine_arguments,
    refuse_unapplied_settings,
    sampling_arguments,
    token_logprobs,
    user_engine_arguments,
)
from pdchat.models import ModelSettings

SETTINGS = ModelSettings(Path("/models/tiny-llama"), "cpu", "auto", names=("tiny",))


def test_engine_arguments_follow_pdchats_settings_and_the_role():
    prefill = engine_arguments("prefill", SETTINGS, {}, "prefill_0", on_cpu=True, environ={})
    decode = engine_arguments("decode", SETTINGS, {"max_running": "8"}, "decode_0", on_cpu=True, environ={})
    assert prefill["model"] == "/models/tiny-llama" and prefill["served_model_name"] == "tiny"
    assert prefill["dtype"] == "float32"  # pdchat's auto on CPU
    assert prefill["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert decode["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert decode["kv_transfer_config"]["kv_load_failure_policy"] == "recompute"
    assert decode["kv_transfer_config"]["kv_buffer_device"] == "cpu"
    assert decode["max_num_seqs"] == 8 and "max_num_seqs" not in prefill
    assert prefill["kv_transfer_config"]["engine_id"] != decode["kv_transfer_config"]["engine_id"]
    assert "kv_events_config" not in decode
    assert decode["enable_chunked_prefill"] is False  # on CPU: a seeded request's chunks fail vLLM's engine
    lease = prefill["kv_transfer_config"]["kv_connector_extra_config"]["kv_lease_duration"]
    assert lease >= 60 + 10  # past the handles' expiry (kv_ttl_s, 60 s by default)
    on_gpu = engine_arguments("decode", SETTINGS, {}, "decode_0", on_cpu=False, environ={})
    assert on_gpu["dtype"] == "auto" and on_gpu["kv_transfer_config"]["kv_buffer_device"] == "cuda"
    assert "enable_chunked_prefill" not in on_gpu
    alone = engine_arguments("decode", SETTINGS, {"vllm_kv_connector": "false"}, "d", on_cpu=True, environ={})
    assert "kv_transfer_config" not in alone


def test_kv_events_go_to_vllms_publisher_on_pdchats_endpoint():
    environ = {"PDCHAT_DECODE_KV_EVENTS_ENDPOINT": "tcp://*:5557", "PDCHAT_KV_EVENTS_TOPIC": "kv"}
    events = engine_arguments("decode", SETTINGS, {}, "decode_0", on_cpu=True, environ=environ)["kv_events_config"]
    assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5557" and events["topic"] == "kv"


def test_the_users_engine_arguments_win_from_text_or_file(tmp_path):
    text = json.dumps({"enforce_eager": True, "dtype": "bfloat16", "kv_transfer_config": None})
    arguments = engine_arguments("decode", SETTINGS, {"vllm_engine_args": text}, "d", on_cpu=True, environ={})
    assert arguments["enforce_eager"] and arguments["dtype"] == "bfloat16" and arguments["kv_transfer_config"] is None
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"gpu_memory_utilization": 0.5}))
    assert user_engine_arguments({"vllm_engine_args": str(path)}, {}) == {"gpu_memory_utilization": 0.5}


@pytest.mark.parametrize(
    ("text", "needle"), [("{broken", "is not JSON"), ("[1]", "must be a JSON object"), ("/no/such.json", "cannot read")]
)
def test_bad_engine_arguments_fail_the_load_naming_the_setting(text, needle):
    with pytest.raises(ModelUnavailable, match="vllm_engine_args") as info:
        user_engine_arguments({"vllm_engine_args": text}, {})
    assert needle in str(info.value)


def test_sampling_arguments_carry_every_control_and_the_kv_transfer():
    params = GenerationParams(
        max_tokens=20,
        seed=5,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias={"17": -100.0},
        min_tokens=3,
        stop_token_ids=(9,),
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        stop=("END",),
    )
    decode = sampling_arguments(params, transfer_params={"remote_engine_id": "p"})
    assert decode["max_tokens"] == 20 and decode["min_tokens"] == 3 and decode["seed"] == 5
    assert (decode["temperature"], decode["top_p"], decode["top_k"], decode["min_p"]) == (0.7, 0.9, 40, 0.05)
    assert decode["logit_bias"] == {17: -100.0} and decode["stop_token_ids"] == [9] and decode["ignore_eos"]
    assert decode["logprobs"] == 2 and not decode["detokenize"]
    assert "stop" not in decode  # pdchat's AnswerText matches stop strings
    assert decode["extra_args"] == {"kv_transfer_params": {"remote_engine_id": "p"}}
    prefill = sampling_arguments(params, prefill=True)
    assert prefill["max_tokens"] == 1 and prefill["min_tokens"] == 1
    assert prefill["extra_args"] == {"kv_transfer_params": {"do_remote_decode": True}}
    plain = sampling_arguments(GenerationParams(max_tokens=4))
    assert plain["top_k"] == -1 and plain["logprobs"] is None and plain["logit_bias"] is None
    assert "extra_args" not in plain


def test_vllms_logprobs_become_pdchats_most_likely_first():
    entries = {
        7: SimpleNamespace(logprob=-2.5, rank=4),  # the sampled token, outside the top 2
        3: SimpleNamespace(logprob=-0.1, rank=1),
        5: SimpleNamespace(logprob=-1.0, rank=2),
    }
    logprobs = token_logprobs(7, entries, 2)
    assert logprobs.token_id == 7 and logprobs.logprob == -2.5
    assert logprobs.top == ((3, -0.1), (5, -1.0))
    assert token_logprobs(3, entries, 0).top == ()


def test_vllms_cpu_kv_cache_is_whole_gib_of_at_least_one():
    assert cpu_kv_cache_gib(256 << 20) == 1 and cpu_kv_cache_gib(3 << 30) == 3 and cpu_kv_cache_gib((3 << 30) + 1) == 4


def test_a_setting_vllms_engine_would_not_apply_is_refused_at_load_by_name():
    """Set by parameter or variable to other than its default, for the role that reads it;
    unset ones, and ones set to their default (an environment shared with pdchat's engine), pass."""
    refuse_unapplied_settings("decode", {}, environ={})
    refuse_unapplied_settings("decode", {"torch_threads": "auto"}, environ={"PDCHAT_DECODE_CPUS": "none"})
    refuse_unapplied_settings("prefill", {}, environ={"PDCHAT_DECODE_KV_SHARE": "0.25"})  # a decode setting
    with pytest.raises(ModelUnavailable) as info:
        refuse_unapplied_settings("decode", {"queue_timeout_s": "5"}, environ={"PDCHAT_DECODE_KV_SHARE": "0.25"})
    message = str(info.value)
    assert "queue_timeout_s (config parameter queue_timeout_s)" in message
    assert "decode_kv_share (PDCHAT_DECODE_KV_SHARE)" in message and "engine vllm" in message
    with pytest.raises(ModelUnavailable, match="torch_threads"):
        refuse_unapplied_settings("prefill", {}, environ={"PDCHAT_TORCH_THREADS": "4"})
    with pytest.raises(ModelUnavailable, match="grammar_compile_timeout_s"):  # vLLM compiles grammars its own way
        refuse_unapplied_settings("decode", {}, environ={"PDCHAT_GRAMMAR_COMPILE_TIMEOUT_S": "30"})
