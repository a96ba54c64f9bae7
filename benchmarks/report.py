"""How the benchmarks report: timing samples, a plain-text table, a PNG plot under bench-results/."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

OUT_DIR = Path("bench-results")


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(
    name: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[list, list]],
    logx: bool = False,
    logy: bool = False,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    OUT_DIR.mkdir(exist_ok=True)
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        axis.plot(xs, ys, marker="o", label=label)
    if logx:
        axis.set_xscale("log")
    if logy:
        axis.set_yscale("log")
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(OUT_DIR / f"{name}.png", dpi=120)
    print(f"plot: {OUT_DIR / f'{name}.png'}")


def write_results(name: str, results: dict) -> None:
    """bench-results/<name>.json: the numbers a README table quotes."""
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / f"{name}.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    print(f"results: {OUT_DIR / f'{name}.json'}")
