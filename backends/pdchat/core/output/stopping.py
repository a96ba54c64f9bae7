"""Stop strings over streamed text: hold back what might be the start of a stop string."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._pending = ""  # text seen but not yet released
        self._settled = 0  # how much of _pending no stop string may end in (fed with match=False)

    def feed(self, text: str, *, match: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string ended the output). With
        `match` false the text is taken but no stop string may end in it (vLLM's min_tokens:
        one may still begin there and end in text fed later)."""
        self._pending += text
        if not match:
            self._settled = len(self._pending)
        else:
            hits = [i for i in (self._find(s) for s in self._stops) if i >= 0]
            if hits:
                released, self._pending, self._settled = self._pending[: min(hits)], "", 0
                return released, True
        cut = max(len(self._pending) - self._holdback, 0)
        released, self._pending = self._pending[:cut], self._pending[cut:]
        self._settled = max(self._settled - cut, 0)
        return released, False

    def flush(self) -> str:
        released, self._pending, self._settled = self._pending, "", 0
        return released

    def _find(self, stop: str) -> int:
        """Where `stop` first occurs in the pending text ending past the settled part; -1: nowhere."""
        return self._pending.find(stop, max(self._settled - len(stop) + 1, 0))
