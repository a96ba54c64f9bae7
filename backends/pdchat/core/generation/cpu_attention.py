"""Decode attention on CPU in C: one query token per row, read in place from the block pool.

Why: on CPU the torch path gathers every row's keys and values out of the pool into a
padded batch, then SDPA reads that copy; at decode's single query per row both are
bandwidth-bound, so the copy is about half the attention's time. `decode_attention.c`
reads each row's slots where they lie, once.

It is called holding the GIL (ctypes.PyDLL): a call lasts a fraction of a millisecond, and
a thread that lets the GIL go mid-step waits, to take it back, for whatever Python the
stage's outbox thread runs meanwhile (up to the interpreter's switch interval). Served at
concurrency 4 and 16 that made steps slower than holding it.

It computes on one thread: the engine uses it when torch runs one thread per stage model
(torch_threads; half the cores, so hosts of up to 3), and leaves attention to SDPA, which
spreads over torch's threads, otherwise.

The kernel is compiled on first use with the host's C compiler (`cc`, or `$CC`) for this
CPU (-march=native) into the cache directory, keyed by its source, flags, compiler and the
CPU's feature flags, so a shared home directory never hands a host another CPU's build.
Without a compiler, or when the build fails, `load()` says why once in the log and returns
None; callers then take the torch path. Math flags: the source is compiled with
-ffast-math (it vectorizes `expf` through glibc's libmvec) and linked without it, which
keeps gcc's crtfastmath (flush-to-zero for the whole process) out of the library.

NOTE: the results equal the torch path's to float rounding, not bit for bit; every row is
computed alone in a fixed order, so a row's result does not depend on the batch around it.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")
_SYMBOL = "pdchat_decode_attention"
_lock = threading.Lock()
_loaded: dict[Path, DecodeAttention | None] = {}


class DecodeAttention:
    """The loaded kernel (see the module docstring for its contract)."""

    def __init__(self, library: ctypes.PyDLL):
        self._kernel = getattr(library, _SYMBOL)
        self._kernel.restype = ctypes.c_int
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._kernel.argtypes = [pointer] * 5 + [size] * 5 + [ctypes.c_float, size, pointer]

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        read: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """query [rows, q_heads, dim]; keys, values one layer's pool [slots, kv_heads, dim]
        (all fp32, on CPU); read [rows, cols] int64 slots; lengths [rows] int64: how many of
        a row's columns it attends over (the last `window` of them when a window is given).
        Returns [rows, q_heads, dim]."""
        query, read, lengths = query.contiguous(), read.contiguous(), lengths.contiguous()
        rows, q_heads, dim = query.shape
        kv_heads = keys.shape[1]
        # NOTE: what the C code takes on trust; a wrong call must raise here, not corrupt memory.
        if not (
            all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (query, keys, values))
            and read.dtype == lengths.dtype == torch.int64
            and keys.is_contiguous()
            and values.is_contiguous()
            and keys.shape == values.shape
            and keys.shape[2] == dim
            and 0 < kv_heads <= q_heads
            and q_heads % kv_heads == 0
            and read.shape[0] == lengths.shape[0] == rows
        ):
            raise ValueError("decode attention got tensors of another layout, dtype or device than it computes")
        out = torch.empty_like(query)
        failed = self._kernel(
            query.data_ptr(),
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


def load(cache_dir: Path) -> DecodeAttention | None:
    """The kernel, built into `cache_dir` if no build for this host is there yet; None
    when it cannot be built here (logged once per process and directory)."""
    with _lock:
        if cache_dir not in _loaded:
            _loaded[cache_dir] = _build_and_load(cache_dir)
        return _loaded[cache_dir]


def _build_and_load(cache_dir: Path) -> DecodeAttention | None:
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        log.warning("no C compiler (cc, gcc or $CC): decode attention takes the torch path")
        return None
    try:
        library = cache_dir / f"decode_attention-{_build_key(compiler)}.so"
        if library.is_file():
            try:
                return DecodeAttention(ctypes.PyDLL(str(library)))
            except (OSError, AttributeError) as exc:  # a damaged file in the cache: built again below
                log.warning("rebuilding the cached decode attention kernel %s: %s", library, exc)
        _compile(compiler, library)
        return DecodeAttention(ctypes.PyDLL(str(library)))
    except Exception as exc:  # noqa: BLE001 - the kernel is optional: any failure means the torch path
        log.warning("decode attention kernel unavailable, taking the torch path: %s", exc)
        return None


def _build_key(compiler: list[str]) -> str:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, errors="replace", timeout=30)
    parts = [SOURCE.read_text(), " ".join(COMPILE_FLAGS), version.stdout, platform.machine(), _cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), as /proc/cpuinfo lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: list[str], library: Path) -> None:
    """Compile, then link without the math flags (see the module docstring), into a
    temporary file renamed into place: processes building at once never load half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        obj, built = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        for command in (
            [*compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [*compiler, "-shared", str(obj), "-o", str(built), "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=120)
            if done.returncode != 0:
                raise subprocess.SubprocessError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, library)
    log.info("built the decode attention kernel: %s", library)
