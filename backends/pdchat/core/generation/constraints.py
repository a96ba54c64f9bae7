"""Constrained decoding: a request's grammar (`pdchat.core.request.grammar` spec) compiled
against the model's tokenizer, masking logits token by token.

Compiles run in a child process (`grammar_worker`), bounded in time; this process keeps the
compiled grammars in an LRU cache bounded in bytes, keyed by the spec's canonical JSON.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.grammar_worker import GrammarWorker
from pdchat.core.settings import CompileOptions


class Constraint:
    """One request's grammar state: masks logits, accepts the chosen tokens."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().cpu().clone().unsqueeze(0)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask)
        return logits[0]

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise InvalidRequest(f"token {token_id} breaks the request's output grammar")


class ConstraintCompiler:
    """Compiles specs for one tokenizer, caching compiled grammars by spec; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, options: CompileOptions):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._options = options
        self._info = None  # xgrammar.TokenizerInfo, made on first use
        self._worker: GrammarWorker | None = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="pdchat-grammar")

    def constraint(self, spec: dict[str, Any] | None) -> Constraint | None:
        """A fresh grammar state for `spec` (None: no constraint); compiles on a cache miss."""
        if spec is None:
            return None
        return Constraint(self._compiled(_canonical(spec)), self._vocab_size)

    def prepare(self, spec: dict[str, Any] | None) -> Future:
        """Compile `spec` off the caller's thread, into the cache; the future fails with the
        request's error (InvalidRequest: bad schema, past the compile deadline)."""
        if spec is None or _canonical(spec) in self._cache:
            done: Future = Future()
            done.set_result(None)
            return done
        return self._background.submit(self._compiled, _canonical(spec))

    def start(self) -> Future:
        """Start the worker process now, in the background, by compiling the JSON-object
        grammar: a serving model's first request with a grammar then waits for no start."""
        return self.prepare({"type": "json_object"})

    def close(self) -> None:
        self._background.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()

    def _compiled(self, key: str):
        import xgrammar as xgr

        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._worker is None:
                self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
                self._worker = GrammarWorker(self._info.serialize_json(), self._options.worker_rss_bytes)
        # NOTE: outside the lock: a hit for another spec never waits behind a compile.
        compiled = xgr.CompiledGrammar.deserialize_json(self._worker.compile(key, self._options.timeout_s), self._info)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
            while self._cached_bytes > self._options.cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.memory_size_bytes
        _return_freed_memory()  # what the transfer and any evicted grammar used goes back to the system
        return compiled


def _canonical(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _return_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
