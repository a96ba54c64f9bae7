"""What the tests of servers on vLLM's engine (setting engine=vllm) share: the python their
models run in, the marks that skip them where it has no vLLM, and their settings."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pdchat.launcher import vllm_python
from tests.integration.conftest import TEST_POOLS

PYTHON = vllm_python(dict(os.environ))
HAS_VLLM = (
    subprocess.run(
        [PYTHON, "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"]
    ).returncode
    == 0
)
VLLM_TESTS = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAS_VLLM, reason=f"no vLLM in {PYTHON}: scripts/bootstrap.sh --vllm builds .venv-vllm"),
]
# Eager (no torch.compile): a server is ready in about 20 s rather than a minute.
ENGINE_ENV = {"PDCHAT_ENGINE": "vllm", "PDCHAT_VLLM_ENGINE_ARGS": json.dumps({"enforce_eager": True}), **TEST_POOLS}
