"""Reading OpenAI logprobs out of responses, and comparing two answers' logprobs: shared by
the pipeline tests and the parity tests on real servers."""

from __future__ import annotations

from typing import Any

# Paths differ only in floating-point summation order (batched or not, KV moved or not).
TOLERANCE = 1e-4


def logprobs_of(responses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every `choices[0].logprobs.content` entry, in order, streamed chunks or one completion."""
    entries = []
    for response in responses:
        for choice in response.get("choices") or []:
            entries += (choice.get("logprobs") or {}).get("content") or []
    return entries


def assert_logprobs_close(
    got: list[dict[str, Any]], expected: list[dict[str, Any]], tolerance: float = TOLERANCE
) -> None:
    """Same tokens (text and bytes), alternatives in the same order, values within `tolerance`."""
    assert len(got) == len(expected), (len(got), len(expected))
    for position, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert _spelled(mine) == _spelled(theirs), position
        assert abs(mine["logprob"] - theirs["logprob"]) <= tolerance, (position, mine["logprob"], theirs["logprob"])
        assert [_spelled(t) for t in mine["top_logprobs"]] == [_spelled(t) for t in theirs["top_logprobs"]], position
        for alternative, reference in zip(mine["top_logprobs"], theirs["top_logprobs"], strict=True):
            assert abs(alternative["logprob"] - reference["logprob"]) <= tolerance, position


def _spelled(entry: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    return entry["token"], tuple(entry["bytes"])
