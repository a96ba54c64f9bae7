"""Model dtypes: the KV leaves prefill and reaches decode in the model's own dtype, through
both connectors, bit for bit; a decode server running another dtype refuses it by name."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.engine import CausalLM, DecodeBatch, pick_dtype
from pdchat.core.kv.base import KVHandle, KVUnavailable, tokens_from
from pdchat.core.kv.shm import ShmConnector
from pdchat.models import resolve_model

PROMPT = list(range(100, 160))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return {name: CausalLM(tiny_model_dir, "cpu", name) for name in ("float32", "bfloat16", "float16")}


def test_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert pick_dtype("auto", "cpu") is torch.float32
    assert pick_dtype("auto", "cuda") is torch.bfloat16
    assert pick_dtype("float16", "cpu") is torch.float16


def test_an_unknown_dtype_is_refused_at_load(tiny_model_dir):
    from pdchat.core.errors import ModelUnavailable

    with pytest.raises(ModelUnavailable, match="dtype must be one of auto, float32, bfloat16, float16"):
        resolve_model({"model": str(tiny_model_dir), "dtype": "int8"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kv_travels_in_the_models_dtype_through_shm_bit_for_bit(engines, tmp_path, dtype):
    engine = engines[dtype]
    assert engine.model.dtype == getattr(torch, dtype)
    logits, sequence = engine.prefill(PROMPT)
    kv = engine.export_kv(sequence)
    assert kv.nbytes == len(PROMPT) * engine.kv_bytes_per_token(), "2 bytes a value in 16-bit dtypes, not 4"
    prefill, decode = ShmConnector(tmp_path / "kv"), ShmConnector(tmp_path / "kv")
    try:
        handle = prefill.publish(kv, int(logits.argmax()))
        assert handle.dtype == dtype
        handle = KVHandle.from_json(handle.to_json())  # as decode receives it
        pulled = decode.pull(handle)
        assert pulled.dtype == kv.dtype and np.array_equal(pulled.view(np.uint8), kv.view(np.uint8))
        sequence.release()
        engine.pool.clear_cache()  # so the import writes every block, not the cached ones
        imported = engine.import_kv(lambda start: tokens_from(pulled, start), PROMPT)
        assert imported.cached_tokens == 0 and engine.pool.keys.dtype == engine.dtype
        assert np.array_equal(engine.export_kv(imported).view(np.uint8), kv.view(np.uint8))
        imported.release()
        decode.done(handle)
    finally:
        prefill.close()
        decode.close()


def test_a_16_bit_batch_decodes_and_its_logits_are_float32_for_sampling(engines):
    engine = engines["bfloat16"]
    batch = DecodeBatch(engine)
    for prompt in (PROMPT, PROMPT[:17]):
        batch.join(engine.prefill(prompt)[1])
    logits = batch.step([5, 6])
    assert logits.shape == (2, engine.vocab_size) and logits.dtype == torch.float32
    # 61 and 18 tokens held, by whole blocks of 16 (the 17-token prompt shares PROMPT's first block)
    assert batch.kv_bytes() == (4 + 1) * 16 * engine.kv_bytes_per_token()
    batch.leave([0, 1])
    assert batch.kv_bytes() == 0


@pytest.mark.parametrize(
    ("prefill_dtype", "decode_dtype"), [("bfloat16", "float32"), ("float32", "float16"), ("float16", "bfloat16")]
)
def test_kv_in_another_dtype_is_refused_by_name(engines, prefill_dtype, decode_dtype):
    kv = _exported(engines[prefill_dtype])
    with pytest.raises(InvalidRequest, match=f"the KV is {prefill_dtype}; this server's model runs in {decode_dtype}"):
        engines[decode_dtype].import_kv(lambda start: kv, PROMPT)
    assert engines[decode_dtype].pool.usage().used_blocks == 0


def test_a_handle_naming_an_unknown_dtype_is_malformed():
    handle = KVHandle("shm", (1, 2, 1, 3, 4), time.time() + 60, 0, {"name": "x"})
    assert KVHandle.from_json(handle.to_json()).dtype == "float32"
    forged = {**handle.to_dict(), "dtype": "int8"}
    with pytest.raises(KVUnavailable, match="dtype 'int8' is none of float32, float16, bfloat16"):
        KVHandle.from_dict(forged)
    assert dataclasses.replace(handle, dtype="bfloat16").nbytes == 1 * 2 * 1 * 3 * 4 * 2


def test_kv_travels_in_bfloat16_through_nixl_bit_for_bit(engines):
    pytest.importorskip("nixl_cu12")
    from pdchat.core.kv.nixl import NixlConnector

    engine = engines["bfloat16"]
    kv = _exported(engine)
    prefill, decode = NixlConnector(ttl_s=60), NixlConnector()
    try:
        handle = KVHandle.from_json(prefill.publish(kv, 1).to_json())
        assert handle.dtype == "bfloat16"
        pulled = decode.pull(handle)
        assert pulled.dtype == np.uint16 and np.array_equal(pulled, kv)
        engine.import_kv(lambda start: tokens_from(pulled, start), PROMPT).release()
    finally:
        prefill.close()
        decode.close()


def test_refused_kv_is_handed_back_at_once_not_held_until_its_ttl(tiny_model_dir, engines):
    from pdchat.core.generation.generation import TextModel
    from pdchat.core.generation.sampling import Choice
    from pdchat.core.request.protocol import ChatRequest

    model = TextModel(tiny_model_dir, "cpu")  # float32
    kv = _exported(engines["bfloat16"])
    params = ChatRequest(messages=[{"role": "user", "content": "x"}]).generation_params(
        len(PROMPT), 16384, model.engine.vocab_size, "m"
    )
    released = []
    with pytest.raises(InvalidRequest, match="the KV is bfloat16"):
        model.generation(
            PROMPT,
            params,
            first=Choice(5, None),
            kv_source=lambda start: tokens_from(kv, start),
            on_kv_released=lambda: released.append(True),
        )
    assert released == [True]


def _exported(engine: CausalLM) -> np.ndarray:
    """PROMPT's KV from `engine`, its blocks given back."""
    sequence = engine.prefill(PROMPT)[1]
    try:
        return engine.export_kv(sequence)
    finally:
        sequence.release()
