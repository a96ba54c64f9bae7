"""What a skipped render would have cost: seconds per prompt token, measured here.

Seeded by timing the renderer's own code on a synthetic conversation at start (a
decode server may never render), then kept current from real renders (moving average).
"""

from __future__ import annotations

import time
from collections.abc import Callable

CALIBRATION_WORDS = 1500
SMOOTHING = 0.1


class RenderRate:
    def __init__(self, seconds_per_token: float):
        self.seconds_per_token = seconds_per_token

    @classmethod
    def calibrate(cls, render: Callable[[list[dict]], list[int]], repeats: int = 3) -> RenderRate:
        """Time `render` (messages -> ids) on a conversation of about 2k tokens; keep the best."""
        words = " ".join(
            f"word{i % 97} naïve café ☕" if i % 50 == 0 else f"token{i % 89}" for i in range(CALIBRATION_WORDS)
        )
        messages = [{"role": "system", "content": "Calibration."}, {"role": "user", "content": words}]
        best, tokens = float("inf"), 1
        for _ in range(repeats):
            started = time.perf_counter()
            tokens = max(len(render(messages)), 1)
            best = min(best, time.perf_counter() - started)
        return cls(best / tokens)

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.seconds_per_token += SMOOTHING * (seconds / tokens - self.seconds_per_token)

    def estimate(self, tokens: int) -> float:
        return self.seconds_per_token * tokens
