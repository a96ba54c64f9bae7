"""A model pdchat's engine would compute wrongly is refused at load, naming why and the override."""

import json

import pytest

from pdchat import registry
from pdchat.core.errors import ModelUnavailable
from pdchat.core.generation.model_support import unsupported_features
from pdchat.models import resolve_model

GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 512}


def model_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", [registry.TINY, registry.TINY_GPTOSS])
def test_the_embedded_models_are_supported(name):
    assert resolve_model({"model": name}, {}).path.is_dir()


def test_a_llama_with_a_softcap_is_refused_for_the_softcap_alone():
    assert unsupported_features({"model_type": "llama", "attn_logit_softcapping": 50.0}) == [
        "attention logit softcapping (attn_logit_softcapping)"
    ]
    assert unsupported_features({"model_type": "llama", "attn_logit_softcapping": None}) == []


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (GEMMA2, ["'gemma2'", "attention logit softcapping", "final logit softcapping"]),
        (QWEN3_NEXT, ["'qwen3_next'", "layer_types linear_attention"]),
        (DEEPSEEK, ["'deepseek_v3'", "multi-head latent attention"]),
    ],
)
def test_an_unsupported_model_is_refused_at_load_naming_what_and_the_override(tmp_path, config, named):
    directory = model_dir(tmp_path, config)
    with pytest.raises(ModelUnavailable) as refused:
        resolve_model({"model": str(directory)}, {})
    message = str(refused.value)
    assert config["architectures"][0] in message and "allow_unsupported_model=true" in message
    for part in named:
        assert part in message


def test_the_override_serves_it_anyway(tmp_path):
    directory = model_dir(tmp_path, GEMMA2)
    assert resolve_model({"model": str(directory), "allow_unsupported_model": "true"}, {}).path == directory
    assert resolve_model({"model": str(directory)}, {"PDCHAT_ALLOW_UNSUPPORTED_MODEL": "1"}).path == directory
