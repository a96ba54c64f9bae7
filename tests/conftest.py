"""Shared fixtures: the embedded tiny model (built once into the user cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    from pdchat import embedded

    return embedded.ensure_model(embedded.TINY)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
