"""The C decode-attention kernel: what SDPA over the gathered slots computes, row by row
whatever the batch, sliding windows and grouped heads included; without a compiler the
engine takes the torch path."""

import subprocess
import sys

import pytest
import torch

from pdchat.core.generation import cpu_attention
from pdchat.core.generation.engine import CausalLM

KV_HEADS, Q_HEADS, DIM, SLOTS = 2, 6, 64, 4096


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    loaded = cpu_attention.load(tmp_path_factory.mktemp("kernels"))
    if loaded is None:
        pytest.skip("no C compiler on this host: the kernel is optional")
    return loaded


def _case(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(SLOTS, KV_HEADS, DIM, generator=generator)
    values = torch.randn(SLOTS, KV_HEADS, DIM, generator=generator)
    columns = max(lengths)
    read = torch.zeros(len(lengths), columns, dtype=torch.long)  # slot 0 past a row's end, as the pool pads
    for row, length in enumerate(lengths):
        read[row, :length] = torch.randperm(SLOTS - 1, generator=generator)[:length] + 1
    query = torch.randn(len(lengths), Q_HEADS, DIM, generator=generator)
    return query, keys, values, read, torch.tensor(lengths)


def _sdpa(query, keys, values, read, lengths, window):
    """The torch path: each row's slots gathered, masked past its length (and outside the window)."""
    rows, columns = read.shape
    gathered_k = keys[read].transpose(1, 2)  # [rows, kv_heads, columns, dim]
    gathered_v = values[read].transpose(1, 2)
    position = torch.arange(columns).view(1, -1)
    allowed = position < lengths.view(-1, 1)
    if window is not None:
        allowed &= position >= lengths.view(-1, 1) - window
    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), gathered_k, gathered_v, attn_mask=allowed.view(rows, 1, 1, columns), enable_gqa=True
    )
    return out.squeeze(2)


@pytest.mark.parametrize("window", [None, 16])
def test_the_kernel_computes_what_sdpa_does_over_the_gathered_slots(kernel, window):
    query, keys, values, read, lengths = _case([1, 5, 37, 300, 16, 17])
    ours = kernel(query, keys, values, read, lengths, DIM**-0.5, window)
    torch.testing.assert_close(ours, _sdpa(query, keys, values, read, lengths, window), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel):
    query, keys, values, read, lengths = _case([300, 3, 77])
    batched = kernel(query, keys, values, read, lengths, DIM**-0.5, None)
    for row in range(3):
        alone = kernel(query[row : row + 1], keys, values, read[row : row + 1], lengths[row : row + 1], DIM**-0.5, None)
        assert torch.equal(alone[0], batched[row])


def test_without_a_compiler_the_engine_takes_the_torch_path(tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    assert cpu_attention.load(tmp_path / "kernels") is None
    assert "decode attention" in caplog.text
    engine = CausalLM(tiny_model_dir, "cpu")
    assert engine.decode_attention is None and engine.llama is not None
    logits, sequence = engine.prefill([5, 6, 7])
    assert engine.step([sequence], [int(logits.argmax())]).shape == (1, engine.vocab_size)


def test_a_build_is_reused_from_the_cache(tmp_path):
    first = cpu_attention.load(tmp_path)
    if first is None:
        pytest.skip("no C compiler on this host")
    (library,) = tmp_path.glob("decode_attention-*.so")
    built_at = library.stat().st_mtime_ns
    cpu_attention._loaded.clear()  # as a new process would start
    assert cpu_attention.load(tmp_path) is not None
    assert library.stat().st_mtime_ns == built_at and list(tmp_path.glob("*.so")) == [library]


def test_tensors_it_does_not_compute_are_refused_not_read(kernel):
    query, keys, values, read, lengths = _case([4, 9])
    scale = DIM**-0.5
    for bad in (
        (query.double(), keys, values, read, lengths),  # another dtype
        (query, keys, values, read.int(), lengths),  # int32 slots
        (query, keys.transpose(0, 1), values, read, lengths),  # not [slots, kv_heads, dim]
        (query[:, :5], keys, values, read, lengths),  # 5 query heads over 2 kv heads
    ):
        with pytest.raises(ValueError, match="decode attention"):
            kernel(*bad, scale, None)


def test_a_damaged_cached_build_is_built_again(tmp_path):
    if cpu_attention.load(tmp_path) is None:
        pytest.skip("no C compiler on this host")
    (library,) = tmp_path.glob("decode_attention-*.so")
    library.unlink()  # a new file: this process still maps the old one
    library.write_bytes(b"not a shared object")
    loads = "import sys, pathlib; from pdchat.core.generation import cpu_attention as c; "
    loads += "sys.exit(c.load(pathlib.Path(sys.argv[1])) is None)"
    subprocess.run([sys.executable, "-c", loads, str(tmp_path)], check=True, timeout=120)  # as a new process would
    assert library.read_bytes()[:4] == b"\x7fELF"
