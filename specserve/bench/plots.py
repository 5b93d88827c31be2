"""The sweep's plots: throughput and tokens per step against num_assistant_tokens, or throughput against
concurrency (a panel per method). matplotlib's Figure, not pyplot: no global figure state, no GUI backend."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.bench.sweep import SweepPoint


def plot(points: list[SweepPoint], path: Path) -> None:
    """Against concurrency when the points span several, else against num_assistant_tokens."""
    if len({p.concurrency for p in points}) > 1:
        return plot_concurrency(points, path)
    points = [p for p in points if isinstance(p.num_assistant_tokens, int)]    # over k: "auto" has no place
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    fig = Figure(figsize=(11, 4), layout="constrained")
    throughput_ax, steps_ax = fig.subplots(1, 2)
    baseline = next((p for p in points if p.num_assistant_tokens == 0), None)
    for method in dict.fromkeys(p.method for p in points if p.num_assistant_tokens > 0):
        drafting = sorted((p for p in points if p.method == method and p.num_assistant_tokens > 0),
                          key=lambda p: p.num_assistant_tokens)
        ks = [p.num_assistant_tokens for p in drafting]
        throughput_ax.plot(ks, [p.output_throughput for p in drafting], marker="o", label=method)
        steps_ax.plot(ks, [p.tokens_per_step for p in drafting], marker="o", label=f"{method} tokens/step")
        steps_ax.plot(ks, [p.acceptance_length or float("nan") for p in drafting], marker="x", linestyle=":",
                      label=f"{method} acceptance length")
    if baseline is not None:
        throughput_ax.axhline(baseline.output_throughput, color="gray", linestyle="--", label="plain decoding")
        steps_ax.axhline(1.0, color="gray", linestyle="--", label="plain decoding")
    throughput_ax.set(xlabel="num_assistant_tokens", ylabel="output tokens/s", title="Throughput")
    steps_ax.set(xlabel="num_assistant_tokens", ylabel="tokens", title="Tokens per target step")
    for ax in (throughput_ax, steps_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def concurrency_lines(points: list[SweepPoint]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """One panel per drafting method: each setting's line, label -> (concurrencies, output tokens/s). Plain is in
    each panel as measured inside that method's block (interleaved with it), else the median of every plain run."""
    def line(keep) -> tuple[list[int], list[float]]:
        by_concurrency: dict[int, list[float]] = {}
        for p in points:
            if keep(p):
                by_concurrency.setdefault(p.concurrency, []).append(p.output_throughput)
        return sorted(by_concurrency), [statistics.median(by_concurrency[c]) for c in sorted(by_concurrency)]

    def plain(method: str) -> tuple[list[int], list[float]]:
        own = line(lambda p: p.num_assistant_tokens == 0 and p.block == method)
        return own if own[0] else line(lambda p: p.num_assistant_tokens == 0)
    panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for method, k in dict.fromkeys((p.method, p.num_assistant_tokens) for p in points if p.num_assistant_tokens != 0):
        panels.setdefault(method, {"plain": plain(method)})[f"k={k}"] = line(
            lambda p, setting=(method, k): (p.method, p.num_assistant_tokens) == setting)
    return panels or {"plain decoding": {"plain": plain("")}}


def plot_concurrency(points: list[SweepPoint], path: Path) -> None:
    """Output tokens/s against concurrency, a panel per method and a line per setting (plain, each k, "auto")."""
    from matplotlib.figure import Figure
    panels = concurrency_lines(points)
    cols, rows = min(len(panels), 2), (len(panels) + 1) // 2
    fig = Figure(figsize=(4.5 * cols + 0.5, 3.2 * rows + 0.5), layout="constrained")
    axes = list(fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).flat)
    style = {"plain": dict(color="gray", linestyle="--"), "k=auto": dict(color="black", linewidth=2.5)}
    for ax, (method, lines) in zip(axes, panels.items()):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", label=label, **style.get(label, dict(linestyle=":")))
        ax.set_xscale("log", base=2)
        ax.set(title=method, xlabel="max concurrency", ylabel="output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Output throughput against concurrency")
    fig.savefig(path, dpi=100)
