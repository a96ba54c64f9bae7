"""Stage-model settings resolved from config parameters and the environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdchat import registry
from pdchat.core import settings as table
from pdchat.core.errors import ModelUnavailable
from pdchat.core.settings import SETTINGS, current_date, stage_lanes, torch_threads
from pdchat.ensemble.gate import Policy
from pdchat.models import resolve_model


def test_torch_threads_default_to_half_the_cores_this_process_may_use():
    assert torch_threads({}, {}) == max(1, len(os.sched_getaffinity(0)) // 2)
    assert torch_threads({"torch_threads": "3"}, {"PDCHAT_TORCH_THREADS": "5"}) == 3, "the parameter comes first"
    assert torch_threads({}, {"PDCHAT_TORCH_THREADS": "5"}) == 5
    with pytest.raises(ModelUnavailable, match="torch_threads must be"):
        torch_threads({"torch_threads": "many"}, {})


def test_harmonys_date_comes_from_the_parameter_then_the_environment_else_today():
    assert current_date({"current_date": "2026-01-02"}, {"PDCHAT_CURRENT_DATE": "2025-05-05"}) == "2026-01-02"
    assert current_date({}, {"PDCHAT_CURRENT_DATE": "2025-05-05"}) == "2025-05-05"
    assert current_date({}, {}) is None


def test_a_kind_gpu_instance_runs_on_the_gpu_triton_gave_it(tiny_model_dir):
    settings = resolve_model({"model": str(tiny_model_dir)}, {})
    assert settings.on_instance("GPU", 1).device == "cuda:1"
    assert settings.on_instance("CPU", 0) == settings, "KIND_CPU: where parameter device says (auto here)"
    assert settings.on_instance("MODEL", 0) == settings
    on_cpu = resolve_model({"model": str(tiny_model_dir), "device": "cpu"}, {})
    with pytest.raises(ModelUnavailable, match="GPU 0 .*KIND_GPU.* says 'cpu'"):
        on_cpu.on_instance("GPU", 0)


def test_chats_stage_lanes_come_from_the_parameter_then_the_environment_else_sixteen():
    assert stage_lanes({}, {}) == 16
    assert stage_lanes({"stage_lanes": "4"}, {"PDCHAT_STAGE_LANES": "8"}) == 4
    assert stage_lanes({}, {"PDCHAT_STAGE_LANES": "8"}) == 8
    with pytest.raises(ModelUnavailable, match="stage_lanes must be positive"):
        stage_lanes({"stage_lanes": "0"}, {})


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.name)
def test_every_default_parses_through_its_own_type(setting):
    value = setting.type.parse(setting.default)  # ValueError on a default its type refuses
    assert setting.get({}, {}) == value


def test_every_setting_is_named_once_and_alike_everywhere():
    readers = {"chat", "renderer", "prefill", "decode", "router", "openai", "pdchat"}
    for setting in SETTINGS:
        assert setting.env == f"PDCHAT_{setting.name.upper()}", setting.name
        assert setting.param in (None, setting.name), setting.name
        assert setting.applies_to and set(setting.applies_to) <= readers, setting.name
        assert setting.doc and "\n" not in setting.doc, setting.name
    assert len({setting.name for setting in SETTINGS}) == len(SETTINGS)
    assert all(getattr(table, setting.name.upper()) is setting for setting in SETTINGS), "the constant of its name"


@pytest.mark.parametrize(
    ("setting", "in_config", "in_env", "configured", "exported"),
    [
        (table.MODEL, "tiny", "smollm2", "tiny", "smollm2"),  # text
        (table.HANDOFF_TTL_S, "2.5", "7", 2.5, 7.0),  # positive number
        (table.STAGE_LANES, "4", "8", 4, 8),  # positive integer
        (table.ALLOW_REQUEST_TEMPLATES, "on", "False", True, False),  # boolean
        (table.FORWARDED_IDS, "signed", "trusted", "signed", "trusted"),  # choice
        (table.TORCH_THREADS, "3", "auto", 3, None),  # auto or a positive integer
    ],
)
def test_the_parameter_beats_the_environment_which_beats_the_default(setting, in_config, in_env, configured, exported):
    parameters, environ = {setting.param: in_config}, {setting.env: in_env}
    assert setting.get(parameters, environ) == configured
    assert setting.get({}, environ) == exported
    assert setting.get({}, {}) == setting.default_value
    assert setting.get({setting.param: ""}, {setting.env: ""}) == setting.default_value, "empty counts as unset"


def test_an_environment_only_setting_ignores_the_config(tmp_path):
    assert table.CACHE_DIR.param is None
    assert table.CACHE_DIR.get({"cache_dir": "/elsewhere"}, {"PDCHAT_CACHE_DIR": str(tmp_path)}) == str(tmp_path)
    assert table.CACHE_DIR.get({}, {}) == str(Path.home() / ".cache" / "pdchat")


@pytest.mark.parametrize(
    ("setting", "parameters", "environ", "message"),
    [
        (
            table.STAGE_LANES,
            {},
            {"PDCHAT_STAGE_LANES": "2x"},
            "stage_lanes must be an integer, got '2x' (PDCHAT_STAGE_",
        ),
        (table.KV_TTL_S, {"kv_ttl_s": "-1"}, {}, "kv_ttl_s must be positive, got '-1' (config parameter kv_ttl_s)"),
        (table.DECODE_KV_MB, {"decode_kv_mb": "lots"}, {}, "decode_kv_mb must be a number, got 'lots'"),
        (table.KV_CONNECTOR, {}, {"PDCHAT_KV_CONNECTOR": "rdma"}, "kv_connector must be one of shm, nixl, got 'rdma'"),
        (table.TORCH_THREADS, {}, {"PDCHAT_TORCH_THREADS": "0"}, "torch_threads must be auto or a positive integer"),
    ],
)
def test_a_refused_value_fails_the_load_naming_the_setting_and_its_source(setting, parameters, environ, message):
    with pytest.raises(ModelUnavailable) as info:
        setting.get(parameters, environ)
    assert message in str(info.value)


def test_the_choices_are_the_ones_their_readers_know():
    for policy in Policy:
        assert table.FORWARDED_IDS.get({"forwarded_ids": policy.value}, {}) == policy.value
    for name in registry.KV_CONNECTORS:
        assert table.KV_CONNECTOR.get({"kv_connector": name}, {}) == name
    with pytest.raises(ModelUnavailable, match="forwarded_ids must be one of off, signed, trusted"):
        table.FORWARDED_IDS.get({"forwarded_ids": "Signed"}, {})


def test_booleans_take_the_usual_spellings_in_any_case():
    for spelling, value in [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF", False),
    ]:
        assert table.ALLOW_REQUEST_TEMPLATES.get({}, {"PDCHAT_ALLOW_REQUEST_TEMPLATES": spelling}) is value, spelling


def test_serving_commands_refuse_a_bad_setting_before_starting_anything(monkeypatch, capsys):
    from pdchat import cli

    table.check_environment({})  # the defaults are fine
    with pytest.raises(ModelUnavailable, match="dtype must be one of"):
        table.check_environment({"PDCHAT_DTYPE": "int3"})
    monkeypatch.setenv("PDCHAT_DECODE_CPUS", "half")
    assert cli.main(["serve", "--model", "tiny"]) == 2
    assert "serve: decode_cpus must be auto, none or a CPU list" in capsys.readouterr().err
