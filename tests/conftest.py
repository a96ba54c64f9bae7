"""Shared fixtures: the embedded tiny model (built once into the user cache), the C kernels."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    from pdchat import embedded, registry

    return embedded.ensure_model(registry.TINY)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The C decode kernels, built for this host into a fresh directory (skips without a compiler)."""
    from pdchat.core.generation import cpu_kernels

    loaded = cpu_kernels.load(tmp_path_factory.mktemp("kernels"))
    if loaded is None:
        pytest.skip("no C compiler on this host: the kernels are optional")
    return loaded


def pytest_collection_modifyitems(items):
    """Every test under tests/integration/ starts real servers: `-m "not integration"` runs
    the fast unit tests alone; `make test` runs both."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
