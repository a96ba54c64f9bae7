"""How busy this server's `decode` is, as `chat` sees it before it picks who prefills.

Each decode instance keeps the count of sequences it holds (queued, prefilling, decoding)
in a file of its own, `decode-load.<instance>` in the server's directory
(pdchat.ensemble.seal.server_directory): 8 bytes, mapped, rewritten only when the count
changes. `chat` reads them all per request it routes (`DecodeLoad.idle`).

A load is a hint, never a guarantee: two requests that read "idle" at once both take it,
and a count is up to one scheduler pass old. A decode instance that died leaves its last
count: a nonzero one reads busy (chat then hands prefill the prompt, as without this), a
zero one reads idle (decode prefills; the request is served either way).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

FILE_PREFIX = "decode-load."
_COUNT = struct.Struct("<q")


class LoadSlot:
    """One decode instance's count, written by its scheduler thread.

    NOTE: one writer per slot (the scheduler thread). A reader may see a count one write
    old: a count is a hint (module docstring), so nothing orders the two."""

    def __init__(self, directory: Path, instance: str):
        self.path = directory / f"{FILE_PREFIX}{instance}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _COUNT.size)
            self._map = mmap.mmap(fd, _COUNT.size)
        finally:
            os.close(fd)
        self._count = -1
        self.set(0)

    def set(self, count: int) -> None:
        """Publish `count` (sequences held now); a no-op when it is the one published."""
        if count != self._count:
            _COUNT.pack_into(self._map, 0, count)
            self._count = count

    def close(self) -> None:
        """Unpublish: chat no longer counts this instance."""
        self._map.close()
        self.path.unlink(missing_ok=True)


class DecodeLoad:
    """The counts every decode instance of one server publishes (LoadSlot), read by `chat`."""

    def __init__(self, directory: Path):
        self.directory = directory

    def held(self) -> int | None:
        """Sequences all decode instances hold now, or None while none publishes a count."""
        total, found = 0, False
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return None
        for name in names:
            if not name.startswith(FILE_PREFIX):
                continue
            try:
                with open(self.directory / name, "rb") as file:
                    data = file.read(_COUNT.size)
            except FileNotFoundError:  # an instance unpublished meanwhile
                continue
            if len(data) == _COUNT.size:
                total += _COUNT.unpack(data)[0]
                found = True
        return total if found else None

    def idle(self) -> bool:
        """Whether decode publishes a count and holds no sequence."""
        return self.held() == 0
