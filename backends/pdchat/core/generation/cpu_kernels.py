"""A decode step's work between its GEMMs, on CPU in C (`decode_kernels.c`).

What: for one query token per row (decode's steps), fp32 on CPU,
- `attention`: single-query paged attention, each row's K/V read where they lie in the pool;
- `rope_store`: the rotary embedding of q and k, in place, and k/v stored at their slots;
- `rms_norm` / `add_rms_norm`: RMSNorm, the second with the residual add before it;
- `silu_mul`: the SwiGLU activation of a fused gate/up projection;
- `argmax`: each row's greedy token;
- `GreedyHead`: each row's greedy token straight from the hidden state, the vocabulary
  projection screened in int8 or bf16 and its few close candidates decided in double (below).

Why: at decode's sizes each of these is a handful of torch ops of a few microseconds of
work and more of dispatch each (rotary alone is six), and attention on the torch path
first gathers every row's keys and values out of the pool into a padded copy. Here each
is one call that reads its inputs once.

Every call is checked in Python first (devices, dtypes, shapes, contiguity, and the ranges
of the slots, positions and lengths it indexes by): the C code takes its arguments on trust, so a wrong call raises
ValueError here instead of corrupting memory. Calls hold the GIL (ctypes.PyDLL): each
lasts microseconds to a fraction of a millisecond, and a thread that lets the GIL go
mid-step waits, to take it back, for whatever Python the stage's outbox thread runs
meanwhile (docs/architecture.md#the-forward-pass).

The engine uses them on whatever torch threads a pass has (torch_threads; more for a
prompt's pass while the stage's cores sit idle, pass_threads): `set_threads` gives the pass's
count to the row kernels and the head's screen, which split their rows, or the vocabulary's
blocks, over them through OpenMP.

The library is built at setup (`pdchat prepare kernels`, which scripts/bootstrap.sh and the
image run: `prepare()`) with the host's C compiler (`cc`, or `$CC`) for this CPU
(-march=native) into the cache directory, keyed by its source, flags, compiler and the CPU's
feature flags, so a shared home directory never hands a host another CPU's build. A server
that finds no build for its host there (`load()`) says so in its log and builds it then, as
setup would have; without a compiler, or when the build fails, `load()` says why once in the
log and returns None, and callers take the torch path. Math flags: the source is compiled with
-ffast-math (it vectorizes `expf` through glibc's libmvec) and linked without it, which
keeps gcc's crtfastmath (flush-to-zero for the whole process) out of the library.

NOTE: results equal the torch path's to float rounding, not bit for bit; every row is
computed alone in a fixed order, so a row's result does not depend on the batch around it.

`GreedyHead`: a greedy row needs only the argmax of its logits, and the vocabulary projection
is most of a small model's decode step (49152 x 256 on tiny: memory-bound at one row, and
beside it at 16). The projection is screened on a copy of the weight, with a bound on each
logit's error, and the tokens whose bound reaches the best are recomputed exactly (in
double, from the fp32 weight), so the token is the exact argmax, not the screen's: a true
tie within double's rounding aside, the token fp32 logits would give, and the same whatever
rows are beside it. Two screens (decode_kernels.c has their bounds): int8 (AVX2: weight rows
and hidden states each quantized by their own largest value, exact integer dot products,
about twice bf16's rate on AVX2) and bf16 (AVX-512 BF16's pair dot products, or AVX2 FMAs
on bf16 pairs widened to fp32). int8's bound follows each row's actual quantization error,
so hidden states with outlier channels (SmolLM2's) widen it until every token is a
candidate. A row whose candidates exceed `max_candidates` comes back undecided (-1) and takes
the full projection. The head times each way the host has (the screens, and oneDNN's fp32
projection with the same exact decision on its logits under fp32's bound: `decide_rows`) on
the first batch of each row-count bucket, charging each the full projection of the rows it
left undecided, and keeps the fastest: the tokens are the same either way. Its calls release
the GIL (ctypes.CDLL): they last milliseconds, and the outbox thread sends the previous
step's responses meanwhile.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_kernels.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")
# Tried first: a compiler without OpenMP builds the kernels without it (on the calling thread alone).
OPENMP_FLAGS = ("-fopenmp",)
_lock = threading.Lock()
_loaded: dict[Path, DecodeKernels | None] = {}
_P, _N, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Each C function's argument types, by its name after the `pdchat_` prefix.
_SIGNATURES = {
    "decode_attention": ([_P, _N, _P, _P, _P, _P] + [_N] * 5 + [_F, _N, _P], ctypes.c_int),
    "rope_store": ([_P] * 7 + [_N] * 4, None),
    "rms_norm": ([_P, _P, _N, _N, _F, _P], None),
    "add_rms_norm": ([_P, _P, _P, _N, _N, _F, _P], None),
    "silu_mul": ([_P, _N, _N, _P], None),
    "argmax": ([_P, _N, _N, _P], None),
    "pack_head_bf16": ([_P, _N, _N, _P], None),
    "head_screens": ([], ctypes.c_int),
    "prompt_attention_max_dim": ([], ctypes.c_int),
    "set_threads": ([ctypes.c_int], None),
}
# Called through a GIL-releasing handle (see GreedyHead).
_RELEASING_SIGNATURES = {
    "head_argmax": ([ctypes.c_int, _P, _N, _N] + [_P] * 6 + [_N, _F, _F, _N, _P, _P], ctypes.c_int),
    "decide_rows": ([_P, _N, _N, _P, _P, _N, _P, _F, _F, _N, _P], None),
    "prompt_attention": ([_P, _N, _P, _P, _P] + [_N] * 5 + [_F, _P], ctypes.c_int),
}
# Row-count buckets the GreedyHead times its ways in, once each, on its first batch: a
# batch takes its bucket's winner (the smallest bucket at least its size; the last beyond it).
SCREEN_BUCKETS = (1, 2, 4, 8, 16, 32)
# decode_kernels.c's screens of the GreedyHead, by their codes there.
_HEAD_BF16, _HEAD_INT8 = 1, 2
_HEAD_SCREENS = {"int8": _HEAD_INT8, "bf16": _HEAD_BF16}
# bf16 keeps 8 significant bits: each of x and W rounds by at most 2^-8 of itself.
_BF16_UNIT = 2.0**-8
_FP32_UNIT = 2.0**-24


class DecodeKernels:
    """The loaded library (see the module docstring for its contract)."""

    def __init__(self, library: Path):
        for handle, signatures in ((ctypes.PyDLL, _SIGNATURES), (ctypes.CDLL, _RELEASING_SIGNATURES)):
            loaded = handle(str(library))
            for name, (argtypes, restype) in signatures.items():
                function = getattr(loaded, f"pdchat_{name}")
                function.argtypes, function.restype = argtypes, restype
                setattr(self, f"_{name}", function)
        # The GreedyHead's screens the compiled library has: "int8" (AVX2), "bf16" (AVX-512 BF16, or AVX2 with FMA).
        screens = self._head_screens()
        self.head_screens = tuple(name for name, code in _HEAD_SCREENS.items() if screens & code)
        self.isa = instruction_set()  # what -march=native compiled them for, by name
        # The largest head dim the prompt attention takes (MAX_DIM in the C source); 0: not compiled (no AVX-512).
        self.prompt_attention_max_dim = self._prompt_attention_max_dim()

    def set_threads(self, threads: int) -> None:
        """Let the row kernels and the head's screen split their work over `threads` (the
        stage's torch threads for its next pass); one keeps them on the calling thread.
        NOTE: process-wide, as torch.set_num_threads is: one stage model per process."""
        self._set_threads(threads)

    def attention(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        read: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """query [rows, q_heads, dim] (read in place when only its rows are strided, as q's
        columns of a fused qkv projection are; copied otherwise); keys, values one layer's
        pool [slots, kv_heads, dim]; read [rows, cols] int64 slots; lengths [rows] int64:
        how many of a row's columns it attends over (the last `window` of them when a
        window is given). Returns [rows, q_heads, dim]."""
        query = _attention_query(query, keys, values)
        rows, q_heads, dim = query.shape
        kv_heads = keys.shape[1]
        _check(
            _int64_cpu(read, lengths)
            and _contiguous(read, lengths)
            and read.dim() == 2
            and lengths.shape == (rows,)
            and read.shape[0] == rows
            and _within(lengths, 0, read.shape[1] + 1)
            and _within(read, 0, keys.shape[0])
        )
        out = torch.empty(rows, q_heads, dim)
        failed = self._decode_attention(
            query.data_ptr(),
            query.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            read.data_ptr(),
            lengths.data_ptr(),
            rows,
            read.shape[1],
            q_heads,
            kv_heads,
            dim,
            scale,
            window or 0,
            out.data_ptr(),
        )
        if failed:
            raise MemoryError("decode attention could not allocate its scores")
        return out

    def takes_prompt_attention(self, dim: int) -> bool:
        """Whether `prompt_attention` serves heads of `dim`: compiled (AVX-512), dim a
        multiple of 16 and at most `prompt_attention_max_dim`."""
        return dim % 16 == 0 and 0 < dim <= self.prompt_attention_max_dim

    def prompt_attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One prompt chunk's causal attention: query [queries, q_heads, dim] (read in place
        when only its rows are strided; copied otherwise), query i at position n - queries +
        i of the n positions whose slots in one layer's pool (keys, values [slots, kv_heads,
        dim]) `read` [n] int64 holds, each attending over the positions up to its own.
        Returns [queries, q_heads, dim]. Releases the GIL while it runs (milliseconds)."""
        query = _attention_query(query, keys, values)
        queries, q_heads, dim = query.shape
        kv_heads = keys.shape[1]
        _check(
            self.takes_prompt_attention(dim)
            and _int64_cpu(read)
            and _contiguous(read)
            and read.dim() == 1
            and 0 < queries <= read.shape[0]
            and _within(read, 0, keys.shape[0])
        )
        out = torch.empty(queries, q_heads, dim)
        failed = self._prompt_attention(
            query.data_ptr(),
            query.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            read.data_ptr(),
            queries,
            read.shape[0],
            q_heads,
            kv_heads,
            dim,
            scale,
            out.data_ptr(),
        )
        if failed:
            raise MemoryError("prompt attention could not allocate its packed keys and values")
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        write: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        q_heads: int,
    ) -> None:
        """In place: q and k of qkv [rows, (q_heads + 2 kv_heads) * dim] rotated by the
        tables cos, sin [positions, dim] at positions [rows] (int64), then each row's k and
        v stored at slot write[row] of keys, values [slots, kv_heads, dim]."""
        slots, kv_heads, dim = keys.shape
        rows = qkv.shape[0]
        _check(
            _fp32_cpu(qkv, cos, sin, keys, values)
            and _int64_cpu(positions, write)
            and _contiguous(qkv, cos, sin, positions, write, keys, values)
            and keys.shape == values.shape
            and qkv.shape == (rows, (q_heads + 2 * kv_heads) * dim)
            and cos.dim() == 2
            and cos.shape == sin.shape
            and cos.shape[1] == dim
            and dim % 2 == 0
            and positions.shape == write.shape == (rows,)
            and _within(positions, 0, cos.shape[0])
            and _within(write, 0, slots)
        )
        self._rope_store(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            write.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            rows,
            q_heads,
            kv_heads,
            dim,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight, x [rows, width]."""
        _check(_fp32_cpu(x, weight) and _contiguous(x, weight) and x.dim() == 2 and weight.shape == x.shape[1:])
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
    ) -> None:
        """hidden += delta, then out = RMSNorm(hidden) * weight; all [rows, width] but weight."""
        _check(
            _fp32_cpu(hidden, delta, weight, out)
            and _contiguous(hidden, delta, weight, out)
            and hidden.dim() == 2
            and hidden.shape == delta.shape == out.shape
            and weight.shape == hidden.shape[1:]
        )
        rows, width = hidden.shape
        self._add_rms_norm(hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(), rows, width, eps, out.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [rows, 2 * inter] (gate, then up): [rows, inter]."""
        _check(_fp32_cpu(gate_up) and _contiguous(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter)
        self._silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
        return out

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's index of its largest logit (the first on a tie), logits [rows, vocab]."""
        _check(_fp32_cpu(logits) and _contiguous(logits) and logits.dim() == 2 and logits.shape[1] > 0)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
        return out.tolist()


@dataclass(frozen=True)
class _Screen:
    """One screen's copy of the head's weight, as decode_kernels.c's pdchat_head_argmax takes it."""

    code: int  # _HEAD_BF16 or _HEAD_INT8
    packed: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    err_norms: torch.Tensor
    q_norms: torch.Tensor
    err_scale: float


class GreedyHead:
    """Each row's greedy token of `hidden @ weight^T` without its logits (see the module
    docstring): `argmax(hidden)` -> a token per row, -1 where the row is undecided.

    `project` computes the fp32 logits of rows (hidden [rows, width] -> [rows, vocab]; the
    engine's vocabulary projection, `hidden @ weight^T` by default). `way`: the way every
    batch takes ("int8", "bf16": that screen; "fp32": the projection); None times each way
    this host has on a row-count bucket's first batch (with the full projection its
    undecided rows then take) and keeps the fastest for the bucket.

    NOTE: holds each screen's copy of the weight (a quarter of its size in int8, half in
    bf16), made here. One thread at a time: the scratch buffer is shared by calls."""

    def __init__(
        self,
        kernels: DecodeKernels,
        weight: torch.Tensor,
        max_candidates: int = 64,
        project: Callable[[torch.Tensor], torch.Tensor] | None = None,
        way: str | None = None,
    ):
        width = weight.shape[1]
        self._kernels, self._weight, self._max_candidates = kernels, weight.detach().contiguous(), max_candidates
        self._project = project or (lambda hidden: hidden @ self._weight.t())
        self._norms = _rounded_up(self._weight.double().norm(dim=1))
        self._scratch = torch.empty(0)  # grown to rows x vocab floats as batches need
        gamma = width * _FP32_UNIT / (1 - width * _FP32_UNIT)
        self._fp32_slack_scale = 1.01 * gamma  # fp32's sums alone, any order
        # What flushing denormals (below 2^-126) to zero can add, per logit.
        self._slack_floor = width * 2.0**-126 * float(self._weight.abs().max()) * 4 + 2.0**-100
        self._screens = {name: self._screen(name, gamma) for name in _screens_fitting(kernels, self._weight)}
        self.way_names = (*self._screens, "fp32")
        if way is not None and way not in self.way_names:
            raise ValueError(f"GreedyHead way {way!r} is not one of {self.way_names} here")
        # bucket -> the way its batches take; a bucket not in it yet is timed on its first batch
        self.ways: dict[int, str] = {} if way is None else dict.fromkeys(SCREEN_BUCKETS, way)

    def _screen(self, name: str, gamma: float) -> _Screen:
        if name == "int8":  # the C code bounds each row by its own quantization: no err_scale
            packed, scales, offsets, err_norms, q_norms = _int8_head(self._weight)
            return _Screen(_HEAD_INT8, packed, scales, offsets, err_norms, q_norms, 0.0)
        vocab, width = self._weight.shape
        packed = torch.empty(vocab * width, dtype=torch.int16)
        self._kernels._pack_head_bf16(self._weight.data_ptr(), vocab, width, packed.data_ptr())
        # The error bound, by |x| |w_v| (Cauchy-Schwarz): both roundings to bf16, then fp32's
        # sums of `width` products (gamma_n), with 1% to spare.
        err_scale = 1.01 * ((2 * _BF16_UNIT + _BF16_UNIT**2) + gamma * (1 + _BF16_UNIT) ** 2)
        unused = torch.empty(0)
        return _Screen(_HEAD_BF16, packed, unused, unused.int(), self._norms, self._norms, err_scale)

    @classmethod
    def fits(cls, kernels: DecodeKernels | None, weight: torch.Tensor) -> bool:
        """Whether a GreedyHead can serve `weight` [vocab, width] here (a screen of this
        host's build takes it)."""
        return bool(_screens_fitting(kernels, weight))

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        """hidden [rows, width], fp32: each row's greedy token, -1 where undecided (more
        than `max_candidates` close to the best, or a hidden state out of a screen's range)."""
        width = self._weight.shape[1]
        _check(_fp32_cpu(hidden) and hidden.dim() == 2 and hidden.shape[1] == width)
        hidden = hidden.contiguous()
        rows = hidden.shape[0]
        if rows == 0:
            return []
        # NOTE: the C code is built with -ffast-math, which assumes finite values: these rows never reach it.
        bounded = torch.isfinite(hidden).all(dim=1) & (hidden.abs().amax(dim=1) < 2.0**64)
        if not bool(bounded.all()):
            return [-1] * rows
        bucket = next((size for size in SCREEN_BUCKETS if size >= rows), SCREEN_BUCKETS[-1])
        if bucket not in self.ways:
            self.ways[bucket] = self._fastest_way(hidden)
            log.info("GreedyHead: batches of up to %d rows take the %s way", bucket, self.ways[bucket])
        return self._tokens(self.ways[bucket], hidden)

    def _tokens(self, way: str, hidden: torch.Tensor) -> list[int]:
        return self._decided(hidden) if way == "fp32" else self._screened(self._screens[way], hidden)

    def _screened(self, screen: _Screen, hidden: torch.Tensor) -> list[int]:
        """The screen, then the candidates in double."""
        vocab = self._weight.shape[0]
        rows = hidden.shape[0]
        if self._scratch.numel() < rows * vocab:
            self._scratch = torch.empty(rows * vocab)
        out = torch.empty(rows, dtype=torch.int64)
        status = self._kernels._head_argmax(
            screen.code,
            hidden.data_ptr(),
            rows,
            hidden.shape[1],
            screen.packed.data_ptr(),
            screen.scales.data_ptr(),
            screen.offsets.data_ptr(),
            self._weight.data_ptr(),
            screen.err_norms.data_ptr(),
            screen.q_norms.data_ptr(),
            vocab,
            screen.err_scale,
            self._slack_floor,
            self._max_candidates,
            self._scratch.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"the screen of the vocabulary projection failed ({status})")
        return out.tolist()

    def _decided(self, hidden: torch.Tensor) -> list[int]:
        """The fp32 projection, then the candidates its bound leaves in double."""
        vocab, width = self._weight.shape
        logits = self._project(hidden).float().contiguous()
        _check(_fp32_cpu(logits) and tuple(logits.shape) == (hidden.shape[0], vocab))
        out = torch.empty(hidden.shape[0], dtype=torch.int64)
        self._kernels._decide_rows(
            hidden.data_ptr(),
            hidden.shape[0],
            width,
            self._weight.data_ptr(),
            self._norms.data_ptr(),
            vocab,
            logits.data_ptr(),
            self._fp32_slack_scale,
            self._slack_floor,
            self._max_candidates,
            out.data_ptr(),
        )
        return out.tolist()

    def _fastest_way(self, hidden: torch.Tensor, rounds: int = 5) -> str:
        """The fastest way on `hidden` here (best of `rounds`, the ways interleaved), each
        timed with the full projection of the rows it leaves undecided. All give the same tokens."""
        best = dict.fromkeys(self.way_names, float("inf"))
        for _ in range(rounds):
            for way in best:
                started = time.perf_counter()
                undecided = [row for row, token in enumerate(self._tokens(way, hidden)) if token < 0]
                if undecided:
                    self._project(hidden[undecided]).argmax(dim=-1)
                best[way] = min(best[way], time.perf_counter() - started)
        return min(best, key=best.__getitem__)


def _screens_fitting(kernels: DecodeKernels | None, weight: torch.Tensor) -> tuple[str, ...]:
    """The screens of this host's build that can take `weight` [vocab, width], fp32."""
    if kernels is None or not _fp32_cpu(weight) or weight.dim() != 2:
        return ()
    weight = weight.detach()
    vocab, width = weight.shape
    largest = weight.abs().amax(dim=1)
    if not bool(torch.isfinite(largest).all()):
        return ()
    fitting = []
    # int8: each row's scale stays a normal float, and its products too
    in_range = bool(((largest == 0) | (largest >= 2.0**-60)).all()) and float(largest.max()) <= 2.0**32
    if "int8" in kernels.head_screens and vocab % 8 == 0 and width % 4 == 0 and in_range:
        fitting.append("int8")
    if "bf16" in kernels.head_screens and vocab % 16 == 0 and width % 2 == 0:
        fitting.append("bf16")
    return tuple(fitting)


def _int8_head(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """weight [vocab, width] as the int8 screen takes it (decode_kernels.c, HEAD_INT8):
    (packed q [vocab / 8][width / 4][8][4], scales s, offsets 128 * sum q, err_norms >=
    |w - s q|, q_norms >= |s q|), one of each per vocabulary row."""
    vocab, width = weight.shape
    scales = (weight.abs().amax(dim=1) / 64).float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).double()
    q = torch.round(weight.double() / safe[:, None]).clamp(-64, 64)
    dequantized = q * scales.double()[:, None]  # exactly s q: a float times a small integer
    err_norms = _rounded_up((weight.double() - dequantized).norm(dim=1))
    q_norms = _rounded_up(dequantized.norm(dim=1))
    offsets = (128 * q.sum(dim=1)).to(torch.int32)
    packed = q.to(torch.int8).view(vocab // 8, 8, width // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, scales.contiguous(), offsets.contiguous(), err_norms, q_norms


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """Non-negative doubles as floats no smaller than each."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _int64_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.int64 for t in tensors)


def _within(values: torch.Tensor, low: int, high: int) -> bool:
    """Every value in [low, high) (an empty tensor is)."""
    return values.numel() == 0 or (low <= int(values.min()) and int(values.max()) < high)


def _contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


def _attention_query(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`query` [rows, q_heads, dim] as the attention kernels read it: in place when only its
    rows are strided (q's columns of a fused qkv projection are), a contiguous copy
    otherwise. Checks what both kernels take of it and of one layer's pool, keys and values
    [slots, kv_heads, dim] (fp32 CPU, kv heads dividing q heads)."""
    _check(query.dim() == 3)
    _, q_heads, dim = query.shape
    if not (query.stride(2) == 1 and query.stride(1) == dim and query.stride(0) >= q_heads * dim):
        query = query.contiguous()  # rows apart is all the C code can stride over
    _check(
        _fp32_cpu(query, keys, values)
        and _contiguous(keys, values)
        and keys.dim() == 3
        and keys.shape == values.shape
        and keys.shape[2] == dim
        and 0 < keys.shape[1] <= q_heads
        and q_heads % keys.shape[1] == 0
    )
    return query


def _check(valid: bool) -> None:
    # NOTE: what the C code takes on trust; a wrong call must raise here, not corrupt memory.
    if not valid:
        raise ValueError("a decode kernel got tensors of another layout, dtype, shape or device than it computes")


class KernelsUnavailable(Exception):
    """The kernels cannot be built or loaded on this host; the message says why."""


def library_dir() -> Path:
    """Where `pdchat prepare kernels` builds the kernels and servers look for them: the
    cache directory's kernels/ (setting cache_dir)."""
    from pdchat.core.settings import cache_dir

    return cache_dir() / "kernels"


def prepare(cache_dir: Path) -> Path:
    """Build the kernels for this host into `cache_dir` unless a build is there already, and
    check that it loads: setup's step (`pdchat prepare kernels`). The library's path;
    KernelsUnavailable when it cannot be had here."""
    with _lock:
        library, kernels = _open(cache_dir, ahead=True)
        _loaded[cache_dir] = kernels
        return library


def load(cache_dir: Path) -> DecodeKernels | None:
    """The kernels built for this host in `cache_dir` (by `prepare()`, at setup); where none is
    there, built now, with a warning that setup did not. None when they cannot be had here
    (logged once per process and directory)."""
    with _lock:
        if cache_dir not in _loaded:
            _loaded[cache_dir] = _load_or_build(cache_dir)
        return _loaded[cache_dir]


def _load_or_build(cache_dir: Path) -> DecodeKernels | None:
    try:
        library, kernels = _open(cache_dir, ahead=False)
    except KernelsUnavailable as exc:
        log.warning("decode kernels unavailable, taking the torch path: %s", exc)
        return None
    log.info("decode kernels: %s (%s)", library, kernels.isa)
    return kernels


def _open(cache_dir: Path, *, ahead: bool) -> tuple[Path, DecodeKernels]:
    """This host's build in `cache_dir`, built first if it is not there (`ahead`: by setup;
    otherwise at a server's load, which is logged as setup's step missed)."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        raise KernelsUnavailable("no C compiler (cc, gcc or $CC)")
    try:
        library = cache_dir / f"decode_kernels-{_build_key(compiler)}.so"
        if library.is_file():
            try:
                return library, DecodeKernels(library)
            except (OSError, AttributeError) as exc:  # a damaged file in the cache: built again below
                log.warning("rebuilding the cached decode kernels %s: %s", library, exc)
        elif not ahead:
            log.warning(
                "the decode kernels were not built ahead for this host (run `pdchat prepare kernels` at setup): "
                "building them now into %s",
                cache_dir,
            )
        _compile(compiler, library)
        return library, DecodeKernels(library)
    except Exception as exc:  # noqa: BLE001 - whatever the failure, the kernels are not to be had here
        raise KernelsUnavailable(str(exc) or type(exc).__name__) from exc


def _build_key(compiler: list[str]) -> str:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, errors="replace", timeout=30)
    flags = " ".join(COMPILE_FLAGS + OPENMP_FLAGS)
    parts = [SOURCE.read_text(), flags, version.stdout, platform.machine(), cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def instruction_set() -> str:
    """The widest vector instructions this CPU has, by the name the startup log gives them:
    avx512, avx2, else the machine's name (x86_64, aarch64, ...)."""
    flags = cpu_flags().split()
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return platform.machine() or "unknown"


def cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), as /proc/cpuinfo lists them
    (its line, name included), else the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: list[str], library: Path) -> None:
    """Compile, then link without the math flags (see the module docstring), into a
    temporary file renamed into place: processes building at once never load half a file.
    With OpenMP where the compiler has it, else without (logged)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        obj, built = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        try:
            _build(compiler, OPENMP_FLAGS, obj, built)
        except subprocess.SubprocessError as exc:
            log.warning("building the decode kernels without OpenMP (they keep to one thread): %s", exc)
            _build(compiler, (), obj, built)
        os.replace(built, library)
    log.info("built the decode kernels: %s", library)


def _build(compiler: list[str], extra: tuple[str, ...], obj: Path, built: Path) -> None:
    for command in (
        [*compiler, *COMPILE_FLAGS, *extra, "-c", str(SOURCE), "-o", str(obj)],
        [*compiler, "-shared", *extra, str(obj), "-o", str(built), "-lm"],
    ):
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=120)
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
