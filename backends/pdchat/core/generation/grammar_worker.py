"""Grammar compiles in a process of their own: bounded in time, their memory given back.

xgrammar's compile of a schema can take minutes and grow its process by gigabytes (a JSON
schema with tens of thousands of enum values does), in C++ that no Python thread can stop.
`GrammarWorker` runs compiles in a child process: a compile past its deadline is abandoned by
killing the child, and a child grown past its memory bound is replaced, so the serving
process holds only the compiled grammars it keeps.

Wire protocol on the child's stdin/stdout, each message a 4-byte big-endian length and a body:
the parent first sends the tokenizer's `xgrammar.TokenizerInfo` JSON, then one grammar spec
JSON (`pdchat.core.request.grammar`) per compile; the child answers each with `ok` and the
`CompiledGrammar` JSON, or `no` and the reason it cannot build the grammar.

Run as `python -m pdchat.core.generation.grammar_worker` by `GrammarWorker` only.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from pdchat.core.errors import InvalidRequest

_LENGTH = struct.Struct(">I")
_OK, _NO = b"ok", b"no"
# How long a new child may take to import xgrammar and read the tokenizer, before compiles.
START_TIMEOUT_S = 120.0


class GrammarCompileTimeout(InvalidRequest):
    """A grammar took longer to compile than this server allows."""


class GrammarWorker:
    """One child process compiling grammars for one tokenizer, one compile at a time.

    `compile(spec_json, timeout_s)` returns the serialized CompiledGrammar; thread-safe.
    NOTE: the deadline covers the compile alone: a child being started (after a kill, or the
    first time) does not count against the request that waits for it.
    """

    def __init__(self, tokenizer_info_json: str, max_rss_bytes: int):
        self._tokenizer_info = tokenizer_info_json.encode()
        self._max_rss_bytes = max_rss_bytes
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0  # children replaced after a timeout or for their memory

    def compile(self, spec_json: str, timeout_s: float) -> str:
        """The CompiledGrammar JSON of `spec_json`; GrammarCompileTimeout past `timeout_s`,
        InvalidRequest for a grammar xgrammar cannot build."""
        with self._lock:
            child = self._running_child()
            _send(child.stdin, spec_json.encode())
            try:
                status, body = _receive(child.stdout, time.monotonic() + timeout_s)
            except EOFError as exc:  # it died (out of memory, a crash): the next compile starts another
                self._stop_child()
                raise RuntimeError("the grammar worker died compiling this request's output grammar") from exc
            except TimeoutError:
                self._stop_child()
                raise GrammarCompileTimeout(
                    f"the output grammar (response_format or forced tool call) took longer than {timeout_s:g} s to "
                    "compile and was abandoned (setting grammar_compile_timeout_s); simplify the schema"
                ) from None
            if self._child_rss() > self._max_rss_bytes:
                self._stop_child()
        if status != _OK:
            raise InvalidRequest(body.decode())
        return body.decode()

    def close(self) -> None:
        """Stop the child at once, also while a compile or its start is waiting on it."""
        child = self._child
        if child is not None:
            child.kill()  # NOTE: a call waiting on the child's pipe sees EOF and lets go of the lock
        with self._lock:
            self._stop_child()

    def _running_child(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        # NOTE: in this process's group, so that whatever stops the server's group stops it too;
        # and once this process is gone its stdin closes, which ends it.
        self._child = subprocess.Popen([_python(), "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _send(self._child.stdin, self._tokenizer_info)
        try:
            status, body = _receive(self._child.stdout, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self._stop_child()
            raise RuntimeError(f"the grammar worker did not start: {exc!r}") from exc
        if status != _OK:
            raise RuntimeError(f"the grammar worker did not start: {body.decode()}")
        return self._child

    def _stop_child(self) -> None:
        if self._child is None:
            return
        self._child.kill()
        self._child.wait()
        for pipe in (self._child.stdin, self._child.stdout):
            pipe.close()
        self._child = None
        self.restarts += 1

    def _child_rss(self) -> int:
        try:
            pages = int(Path(f"/proc/{self._child.pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0
        return pages * os.sysconf("SC_PAGE_SIZE")


def _python() -> str:
    """This environment's interpreter (inside Triton's stub, sys.executable is the stub)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else (shutil.which("python3") or "python3")


def _send(pipe: BinaryIO, body: bytes) -> None:
    pipe.write(_LENGTH.pack(len(body)) + body)
    pipe.flush()


def _receive(pipe: BinaryIO, deadline: float | None = None) -> tuple[bytes, bytes]:
    """The next message's (status, rest); TimeoutError past `deadline` (monotonic; None: none)."""
    body = _read(pipe, _LENGTH.unpack(_read(pipe, _LENGTH.size, deadline))[0], deadline)
    return body[:2], body[2:]


def _read(pipe: BinaryIO, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    fd = pipe.fileno()
    while left:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], wait)[0]:
            raise TimeoutError
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the grammar worker's pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _serve() -> None:
    """The child: compile each spec that arrives until stdin closes."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # NOTE: whatever a library prints must not reach the protocol's pipe
    requests = sys.stdin.buffer

    import xgrammar as xgr

    from pdchat.core.request.grammar import grammar_for

    status, info = _receive(requests)
    # One thread: the serving process's cores are busy with the model. No cache: the parent keeps one.
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.deserialize_json((status + info).decode()), max_threads=1, cache_enabled=False
    )
    _send(answers, _OK)
    while True:
        try:
            first, rest = _receive(requests)
        except EOFError:
            return
        try:
            compiled = compiler.compile_grammar(grammar_for(json.loads(first + rest)))
        except InvalidRequest as exc:
            _send(answers, _NO + str(exc).encode())
            continue
        _send(answers, _OK + compiled.serialize_json().encode())


if __name__ == "__main__":
    _serve()
