"""How busy this server's `decode` is, as `chat` sees it before it picks who prefills.

Each decode instance keeps the count of sequences it holds (queued, prefilling, decoding),
of those queued at its limits, the tokens its KV pool holds, and when it last held any (on
CLOCK_MONOTONIC, the same in every process of the host), in a file of its own,
`decode-load.<instance>` in the server's directory (pdchat.ensemble.seal.server_directory):
32 bytes, mapped, rewritten only when a count changes. `chat` reads them all per request it
routes (`DecodeLoad.idle`, `DecodeLoad.has_room`).

A load is a hint, never a guarantee: two requests that read "idle" at once both take it,
and a count is up to one scheduler pass old. A decode instance that died leaves its last
count: a nonzero one reads busy (chat then hands prefill the prompt, as without this), a
zero one reads idle (decode prefills; the request is served either way).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

FILE_PREFIX = "decode-load."
# held, queued at the limits, the KV pool's tokens, when it last held any (0.0: never)
_COUNTS = struct.Struct("<qqqd")


class LoadSlot:
    """One decode instance's counts, written by its scheduler thread.

    NOTE: one writer per slot (the scheduler thread). A reader may see counts one write
    old: they are a hint (module docstring), so nothing orders the two."""

    def __init__(self, directory: Path, instance: str, pool_tokens: int, clock: Callable[[], float] = time.monotonic):
        self.pool_tokens, self._clock, self._held_at = pool_tokens, clock, 0.0
        self.path = directory / f"{FILE_PREFIX}{instance}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _COUNTS.size)
            self._map = mmap.mmap(fd, _COUNTS.size)
        finally:
            os.close(fd)
        self._counts = (-1, -1)
        self.set(0)

    def set(self, held: int, queued: int = 0) -> None:
        """Publish `held` (sequences held now) and `queued` (of those, the ones waiting for
        room: decode is at its limits); a no-op when they are the ones published."""
        if (held, queued) != self._counts:
            if held or self._counts[0] > 0:  # holding, or the last of them just left
                self._held_at = self._clock()
            _COUNTS.pack_into(self._map, 0, held, queued, self.pool_tokens, self._held_at)
            self._counts = (held, queued)

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
        counts = self._counts()
        return sum(held for held, _, _, _ in counts) if counts else None

    def held_within(self, seconds: float, now: float) -> bool:
        """Whether an instance holds sequences, or held some less than `seconds` before `now`
        (CLOCK_MONOTONIC)."""
        return any(held or (held_at and now - held_at < seconds) for held, _, _, held_at in self._counts())

    def idle(self) -> bool:
        """Whether decode publishes a count and holds no sequence."""
        return self.held() == 0

    def has_room(self, tokens: int) -> bool:
        """Whether decode would take a request of `tokens` (prompt + max_tokens) as it comes:
        no instance has requests queued for room (at its limits: running sequences or KV),
        and each one's KV pool holds `tokens` (decode refuses a request it cannot). True
        while none publishes counts (nothing known against it)."""
        return all(queued == 0 and tokens <= pool for _, queued, pool, _ in self._counts())

    def _counts(self) -> list[tuple[int, int, int, float]]:
        """(held, queued, pool tokens, when it last held any) of each instance that publishes them."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        counts = []
        for name in names:
            if not name.startswith(FILE_PREFIX):
                continue
            try:
                with open(self.directory / name, "rb") as file:
                    data = file.read(_COUNTS.size)
            except FileNotFoundError:  # an instance unpublished meanwhile
                continue
            if len(data) == _COUNTS.size:
                counts.append(_COUNTS.unpack(data))
        return counts
