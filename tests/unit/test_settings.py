"""Stage-model settings resolved from config parameters and the environment."""

from __future__ import annotations

import os

import pytest

from pdchat.core.errors import ModelUnavailable
from pdchat.core.settings import current_date, stage_lanes, torch_threads
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


def test_chats_stage_lanes_come_from_the_parameter_then_the_environment_else_two():
    assert stage_lanes({}, {}) == 2
    assert stage_lanes({"stage_lanes": "4"}, {"PDCHAT_STAGE_LANES": "8"}) == 4
    assert stage_lanes({}, {"PDCHAT_STAGE_LANES": "8"}) == 8
    with pytest.raises(ModelUnavailable, match="stage_lanes must be positive"):
        stage_lanes({"stage_lanes": "0"}, {})
