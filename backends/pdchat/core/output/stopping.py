"""Stop strings over streamed text: hold back what might be the start of a stop string."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._pending = ""  # text seen but not yet released

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string ended the output)."""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            released, self._pending = self._pending[: min(hits)], ""
            return released, True
        cut = max(len(self._pending) - self._holdback, 0)
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released, False

    def flush(self) -> str:
        released, self._pending = self._pending, ""
        return released
