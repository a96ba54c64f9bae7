"""The C decode kernels: attention computes what SDPA over the gathered slots does, row by
row whatever the batch, sliding windows and grouped heads included; RMSNorm, rotary with
the KV store, SwiGLU and argmax what their torch ops do; wrong tensors are refused before
C reads them; without a compiler the engine takes the torch path, and without OpenMP the
kernels keep to one thread."""

import shutil
import subprocess
import sys

import pytest
import torch

from pdchat.core.generation import cpu_kernels
from pdchat.core.generation.engine import CausalLM

KV_HEADS, Q_HEADS, DIM, SLOTS = 2, 6, 64, 4096


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
def test_attention_computes_what_sdpa_does_over_the_gathered_slots(kernels, window):
    query, keys, values, read, lengths = _case([1, 5, 37, 300, 16, 17])
    ours = kernels.attention(query, keys, values, read, lengths, DIM**-0.5, window)
    torch.testing.assert_close(ours, _sdpa(query, keys, values, read, lengths, window), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels):
    query, keys, values, read, lengths = _case([300, 3, 77])
    batched = kernels.attention(query, keys, values, read, lengths, DIM**-0.5, None)
    for row in range(3):
        one = (query[row : row + 1], keys, values, read[row : row + 1], lengths[row : row + 1])
        alone = kernels.attention(*one, DIM**-0.5, None)
        assert torch.equal(alone[0], batched[row])


def _prompt_case(queries: int, columns: int, q_heads: int = Q_HEADS, dim: int = DIM, seed: int = 0):
    """A chunk's queries (rows strided, as in a fused projection) and its columns' slots."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(SLOTS, KV_HEADS, dim, generator=generator)
    values = torch.randn(SLOTS, KV_HEADS, dim, generator=generator)
    read = torch.randperm(SLOTS, generator=generator)[:columns]
    fused = torch.randn(queries, (q_heads + 2 * KV_HEADS) * dim, generator=generator)
    return fused[:, : q_heads * dim].view(queries, q_heads, dim), keys, values, read


@pytest.mark.parametrize(
    "queries, columns",
    [(1, 1), (7, 7), (16, 16), (37, 37), (300, 300), (5, 41), (40, 1064), (265, 1289), (1, 600)],
)
def test_prompt_attention_computes_what_causal_sdpa_over_the_gathered_slots_does(kernels, queries, columns):
    """A fresh chunk (queries == columns), one after a cached prefix, and a lone query; the
    block and tile edges (8 queries, 16 columns) on both sides."""
    if not kernels.takes_prompt_attention(DIM):
        pytest.skip("the prompt attention needs AVX-512")
    query, keys, values, read = _prompt_case(queries, columns)
    ours = kernels.prompt_attention(query, keys, values, read, DIM**-0.5)
    first = columns - queries
    allowed = torch.arange(columns).view(1, -1) <= torch.arange(first, columns).view(-1, 1)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        keys[read].transpose(0, 1).unsqueeze(0),
        values[read].transpose(0, 1).unsqueeze(0),
        attn_mask=allowed,
        scale=DIM**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_prompt_attention_gives_the_same_numbers_on_any_number_of_threads(kernels):
    if not kernels.takes_prompt_attention(DIM):
        pytest.skip("the prompt attention needs AVX-512")
    case = (*_prompt_case(70, 200), DIM**-0.5)
    one = kernels.prompt_attention(*case)
    kernels.set_threads(2)
    try:
        assert torch.equal(kernels.prompt_attention(*case), one)
    finally:
        kernels.set_threads(1)


def test_prompt_attention_gives_a_query_the_same_bits_however_the_prompt_is_chunked(kernels):
    """The batch invariance's half that is attention's: a query's result depends on its
    position and the columns it sees, not on the chunk it is computed in (a whole prompt,
    a chunk after a cached prefix, a lone last query)."""
    if not kernels.takes_prompt_attention(DIM):
        pytest.skip("the prompt attention needs AVX-512")
    query, keys, values, read = _prompt_case(118, 118)
    whole = kernels.prompt_attention(query, keys, values, read, DIM**-0.5)
    for start, end in ((16, 86), (37, 118), (117, 118), (0, 9)):
        chunk = kernels.prompt_attention(query[start:end], keys, values, read[:end].contiguous(), DIM**-0.5)
        assert torch.equal(chunk, whole[start:end]), (start, end)


def test_tensors_prompt_attention_does_not_compute_are_refused_not_read(kernels):
    if not kernels.takes_prompt_attention(DIM):
        pytest.skip("the prompt attention needs AVX-512")
    query, keys, values, read = _prompt_case(8, 20)
    assert not kernels.takes_prompt_attention(72) and not kernels.takes_prompt_attention(512)
    for bad in (
        (query.double(), keys, values, read),  # another dtype
        (query, keys, values, read.int()),  # int32 slots
        (query[:, :5], keys, values, read),  # 5 query heads over 2 kv heads
        (query, keys, values, read[:7]),  # more queries than columns
        (query, keys, values, read + SLOTS),  # slots outside the pool
        (query, keys, values, read.view(4, 5)),  # not one row's slots
    ):
        with pytest.raises(ValueError, match="decode kernel"):
            kernels.prompt_attention(*bad, DIM**-0.5)


def test_without_a_compiler_the_engine_takes_the_torch_path(tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    assert cpu_kernels.load(tmp_path / "kernels") is None
    assert "decode kernels" in caplog.text
    engine = CausalLM(tiny_model_dir, "cpu")
    assert engine.decode_kernels is None and engine.llama is not None
    logits, sequence = engine.prefill([5, 6, 7])
    assert engine.step([sequence], [int(logits.argmax())]).shape == (1, engine.vocab_size)


def test_a_compiler_without_openmp_builds_them_on_one_thread(tmp_path, monkeypatch, caplog):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this host")
    refusing = tmp_path / "cc-without-openmp"
    refusing.write_text(
        f'#!/bin/sh\ncase "$*" in *-fopenmp*) echo "no OpenMP here" >&2; exit 1;; esac\nexec {compiler} "$@"\n'
    )
    refusing.chmod(0o755)
    monkeypatch.setenv("CC", str(refusing))
    kernels = cpu_kernels.load(tmp_path / "kernels")
    assert kernels is not None and "without OpenMP" in caplog.text
    kernels.set_threads(2)  # taken, and the kernels still compute
    try:
        query, keys, values, read, lengths = _case([5, 40])
        ours = kernels.attention(query, keys, values, read, lengths, DIM**-0.5, None)
        torch.testing.assert_close(ours, _sdpa(query, keys, values, read, lengths, None), rtol=1e-5, atol=1e-5)
    finally:
        kernels.set_threads(1)


def test_a_build_is_reused_from_the_cache(tmp_path):
    first = cpu_kernels.load(tmp_path)
    if first is None:
        pytest.skip("no C compiler on this host")
    (library,) = tmp_path.glob("decode_kernels-*.so")
    built_at = library.stat().st_mtime_ns
    cpu_kernels._loaded.clear()  # as a new process would start
    assert cpu_kernels.load(tmp_path) is not None
    assert library.stat().st_mtime_ns == built_at and list(tmp_path.glob("*.so")) == [library]


def test_tensors_attention_does_not_compute_are_refused_not_read(kernels):
    query, keys, values, read, lengths = _case([4, 9])
    scale = DIM**-0.5
    for bad in (
        (query.double(), keys, values, read, lengths),  # another dtype
        (query, keys, values, read.int(), lengths),  # int32 slots
        (query, keys, values, read.to("meta"), lengths),  # slots that are not in this process's memory
        (query, keys.transpose(0, 1), values, read, lengths),  # not [slots, kv_heads, dim]
        (query[:, :5], keys, values, read, lengths),  # 5 query heads over 2 kv heads
        (query, keys, values, read, lengths + 1),  # a row attending past its columns
        (query, keys, values, read + SLOTS, lengths),  # slots outside the pool
    ):
        with pytest.raises(ValueError, match="decode kernel"):
            kernels.attention(*bad, scale, None)


def test_a_damaged_cached_build_is_built_again(tmp_path):
    if cpu_kernels.load(tmp_path) is None:
        pytest.skip("no C compiler on this host")
    (library,) = tmp_path.glob("decode_kernels-*.so")
    library.unlink()  # a new file: this process still maps the old one
    library.write_bytes(b"not a shared object")
    loads = "import sys, pathlib; from pdchat.core.generation import cpu_kernels as c; "
    loads += "sys.exit(c.load(pathlib.Path(sys.argv[1])) is None)"
    subprocess.run([sys.executable, "-c", loads, str(tmp_path)], check=True, timeout=120)  # as a new process would
    assert library.read_bytes()[:4] == b"\x7fELF"


def test_a_query_read_in_place_from_a_fused_projection_gives_the_same_result(kernels):
    query, keys, values, read, lengths = _case([7, 30])
    fused = torch.cat([query.reshape(2, -1), torch.randn(2, 2 * KV_HEADS * DIM)], dim=1)  # q, then k and v
    strided = fused[:, : Q_HEADS * DIM].view(2, Q_HEADS, DIM)
    heads_apart = query.transpose(0, 1).contiguous().transpose(0, 1)  # another layout: copied, not misread
    assert not strided.is_contiguous() and not heads_apart.is_contiguous()
    expected = kernels.attention(query, keys, values, read, lengths, 0.125, None)
    assert torch.equal(kernels.attention(strided, keys, values, read, lengths, 0.125, None), expected)
    assert torch.equal(kernels.attention(heads_apart, keys, values, read, lengths, 0.125, None), expected)


def _rms_norm(x, weight, eps=1e-5):
    return torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)


def test_rms_norm_and_the_residual_add_before_it(kernels):
    generator = torch.Generator().manual_seed(1)
    hidden, delta = torch.randn(5, 96, generator=generator), torch.randn(5, 96, generator=generator)
    weight = torch.rand(96, generator=generator) + 0.5
    torch.testing.assert_close(kernels.rms_norm(hidden, weight, 1e-5), _rms_norm(hidden, weight))
    residual, out = hidden.clone(), torch.empty_like(hidden)
    kernels.add_rms_norm(residual, delta, weight, 1e-5, out)
    torch.testing.assert_close(residual, hidden + delta)
    torch.testing.assert_close(out, _rms_norm(hidden + delta, weight))


def test_silu_mul_is_swiglu_of_a_fused_gate_up(kernels):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)) * 4
    gate_up[0, :16] = torch.tensor([-200.0, -100, -89, -88, -50, 0, 50, 100] * 2)  # exp overflows past ~88.7
    expected = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected)


def test_rope_store_rotates_q_and_k_in_place_and_stores_k_and_v_at_their_slots(kernels):
    generator = torch.Generator().manual_seed(3)
    rows, positions_total = 3, 50
    qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    angles = torch.rand(positions_total, DIM // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)  # rotate-half tables
    positions, write = torch.tensor([0, 17, 49]), torch.tensor([5, 1, 300])
    keys, values = torch.zeros(SLOTS, KV_HEADS, DIM), torch.zeros(SLOTS, KV_HEADS, DIM)
    heads = qkv.view(rows, -1, DIM)
    qk = heads[:, : Q_HEADS + KV_HEADS]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = qk * c + torch.cat((-qk[..., DIM // 2 :], qk[..., : DIM // 2]), dim=-1) * s  # transformers' formula
    value = heads[:, Q_HEADS + KV_HEADS :].clone()
    kernels.rope_store(qkv, cos, sin, positions, write, keys, values, Q_HEADS)
    torch.testing.assert_close(heads[:, : Q_HEADS + KV_HEADS], rotated)
    torch.testing.assert_close(keys[write], rotated[:, Q_HEADS:])
    assert torch.equal(values[write], value)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[write] = False
    assert not keys[untouched].any() and not values[untouched].any()


def test_argmax_picks_what_torch_does_the_first_on_a_tie(kernels):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(4))
    logits[2, 10] = logits[2, 700] = 50.0  # a tie: the first wins, as torch.argmax
    chosen = kernels.argmax(logits)
    assert chosen == logits.argmax(-1).tolist() and chosen[2] == 10


def test_the_other_kernels_refuse_what_they_do_not_compute(kernels):
    x, weight = torch.randn(4, 8), torch.ones(8)
    qkv = torch.randn(2, (Q_HEADS + 2 * KV_HEADS) * DIM)
    cos = sin = torch.ones(10, DIM)
    keys = values = torch.zeros(SLOTS, KV_HEADS, DIM)
    calls = (
        lambda: kernels.rms_norm(x.double(), weight.double(), 1e-5),  # another dtype
        lambda: kernels.rms_norm(x.t(), weight, 1e-5),  # not contiguous
        lambda: kernels.rms_norm(x, torch.ones(7), 1e-5),  # a weight of another width
        lambda: kernels.add_rms_norm(x, torch.randn(3, 8), weight, 1e-5, torch.empty(4, 8)),  # rows differ
        lambda: kernels.silu_mul(torch.randn(2, 9)),  # no even split into gate and up
        lambda: kernels.argmax(torch.randn(2, 5).t()),  # not contiguous
        lambda: kernels.rope_store(qkv, cos, sin, torch.tensor([0, 10]), torch.tensor([1, 2]), keys, values, Q_HEADS),
        lambda: kernels.rope_store(
            qkv, cos, sin, torch.tensor([0, 1]), torch.tensor([1, SLOTS]), keys, values, Q_HEADS
        ),
        lambda: kernels.rope_store(qkv, cos, sin, torch.tensor([0, 1]), torch.tensor([1, 2]), keys, values, 5),
    )
    for call in calls:
        with pytest.raises(ValueError, match="decode kernel"):
            call()


def test_setup_builds_them_ahead_and_a_server_loads_that_build(tmp_path, caplog):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host")
    library = cpu_kernels.prepare(tmp_path)
    assert library.is_file() and library.parent == tmp_path
    cpu_kernels._loaded.clear()  # as a server's process would start
    assert cpu_kernels.load(tmp_path) is not None
    assert "not built ahead" not in caplog.text and list(tmp_path.glob("*.so")) == [library]


def test_a_server_without_a_build_ahead_says_so_and_builds_it(tmp_path, caplog):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host")
    assert cpu_kernels.load(tmp_path) is not None
    assert "not built ahead" in caplog.text and "pdchat prepare kernels" in caplog.text


def test_prepare_without_a_compiler_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_kernels.KernelsUnavailable):
        cpu_kernels.prepare(tmp_path / "kernels")
