"""`bench sweep`'s verdict on "auto" (issue 17): at each concurrency, auto against the best of plain decoding and
every fixed k, with intervals from the rounds, and whether the rounds so far decide it (`undecided`: the sweep then
runs more rounds there, up to --max-repeats)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.bench.sweep import SweepPoint

GOAL = 0.97         # issue 17: auto >= 0.97 x max(plain, best fixed k) at every concurrency
TIE = 0.02          # and >= the best fixed k at concurrency 1: an interval whose lower end is within this decides it
CONFIDENCE = 0.95   # each end of an interval is a one-sided bound at this level (together: a 90% interval)


def baseline_of(p: SweepPoint, points: list[SweepPoint]) -> SweepPoint | None:
    """The k=0 point at p's concurrency, from p's own block (measured interleaved with it) where there is one."""
    same = [b for b in points if b.num_assistant_tokens == 0 and b.concurrency == p.concurrency]
    return next((b for b in same if b.block == p.block), same[0] if same else None)


@dataclass(slots=True)
class Comparison:
    """One "auto" point against plain decoding and the fastest fixed k > 0 of its method at its concurrency."""
    auto: SweepPoint
    plain: SweepPoint | None
    best: SweepPoint | None

    @property
    def reference(self) -> SweepPoint | None:
        """max(plain, best fixed k), by their medians."""
        return max((q for q in (self.plain, self.best) if q is not None), key=lambda q: q.output_throughput,
                   default=None)


def comparisons(points: list[SweepPoint]) -> list[Comparison]:
    found = []
    for auto in (p for p in points if p.num_assistant_tokens == "auto"):
        fixed = [p for p in points if p.concurrency == auto.concurrency and p.method == auto.method
                 and isinstance(p.num_assistant_tokens, int) and p.num_assistant_tokens > 0]
        found.append(Comparison(auto, baseline_of(auto, points), max(fixed, key=lambda p: p.output_throughput,
                                                                      default=None)))
    return found


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: exact for 1 and 2 degrees of freedom, else the Cornish-Fisher expansion about the
    normal's (within 0.3% of the exact from 3)."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    terms = [(z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384,
             (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160]
    return z + sum(term / df ** (i + 1) for i, term in enumerate(terms))


def paired_interval(runs: list[float] | None, reference: list[float] | None) -> tuple[float, float, float] | None:
    """runs / reference round by round (each round runs the settings back to back, so a slow minute of the machine
    falls on both sides of its ratio): their geometric mean, and the ends of its interval, each a one-sided
    CONFIDENCE bound from Student's t over the rounds' log ratios. None under two rounds."""
    if not runs or not reference or len(runs) != len(reference) or len(runs) < 2 or min(runs + reference) <= 0:
        return None
    logs = [math.log(a / b) for a, b in zip(runs, reference)]
    mean, half = statistics.fmean(logs), t_quantile(CONFIDENCE, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(
        len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def undecided(c: Comparison) -> bool:
    """Whether the rounds so far leave the goal open, so that more rounds are worth their time: the interval of auto /
    max(plain, best k) reaches across GOAL, or at concurrency 1 the interval of auto / best k reaches 1 while its lower
    end is more than TIE under it. Auto's and the others' rounds all go on, interleaved as before."""
    if (interval := paired_interval(c.auto.runs, c.reference.runs if c.reference else None)) \
            and interval[1] < GOAL <= interval[2]:
        return True
    at_one = c.auto.concurrency == 1 and c.best is not None
    return bool(at_one and (interval := paired_interval(c.auto.runs, c.best.runs))
                and interval[1] < 1 - TIE and interval[2] >= 1)


def auto_against_fixed(points: list[SweepPoint]) -> str:
    """Per method and concurrency: "auto" against the best of plain decoding and every fixed k measured (the
    goal: auto >= GOAL x that everywhere, and >= the best fixed k at concurrency 1), as a markdown table: the ratio
    of the medians; with --repeats the rounds' paired ratio against that same best setting and its interval
    (`paired_interval`), whether a ratio under the goal is more than the machine's noise (`verdict`), auto against
    the best fixed k alone, paired, and the rounds run."""
    sigma = round_noise(points)
    lines = ["| method | concurrency | plain tok/s | best fixed k (tok/s) | auto tok/s | auto mean k | "
             f"auto / max(plain, best k) | paired rounds (90%) | {GOAL}x? | auto / best k, paired (90%) | rounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons(points):
        auto, plain, best, reference = c.auto, c.plain, c.best, c.reference
        ratio = auto.output_throughput / reference.output_throughput if reference and reference.output_throughput \
            else None
        lines.append(f"| {auto.method} | {auto.concurrency} | {plain.output_throughput if plain else float('nan'):.1f} "
                     f"| {best.num_assistant_tokens if best else '-'} ({best.output_throughput if best else 0:.1f}) "
                     f"| {auto.output_throughput:.1f} | {auto.mean_draft_length or 0:.2f} "
                     f"| {'-' if ratio is None else f'{ratio:.2f}x'} "
                     f"| {interval_text(auto, reference)} | {verdict(ratio, auto, reference, sigma)} "
                     f"| {interval_text(auto, best)} | {len(auto.runs or []) or 1} |")
    if sigma is not None:
        lines.append(f"\nOne round's throughput varies by {sigma:.1%} (s.d. of its log about its setting's mean, pooled "
                     "over every setting): \"within noise\" is a ratio under the goal whose 95% interval reaches it.")
    return "\n".join(lines)


def round_noise(points: list[SweepPoint]) -> float | None:
    """The s.d. of one round's log throughput about its setting's mean, pooled over every setting with rounds."""
    squares, dof = 0.0, 0
    for p in points:
        logs = [math.log(x) for x in p.runs or [] if x > 0]
        if len(logs) > 1:
            mean = statistics.fmean(logs)
            squares, dof = squares + sum((x - mean) ** 2 for x in logs), dof + len(logs) - 1
    return math.sqrt(squares / dof) if dof else None


def verdict(ratio: float | None, auto: SweepPoint, reference: SweepPoint | None, sigma: float | None) -> str:
    """"met"; "below" where the ratio's 95% interval (its two sides' rounds, each `sigma`) stays under GOAL; else
    "within noise". The reference is the best of several noisy settings, so a true 1.00 reads low more often."""
    if ratio is None:
        return "-"
    if ratio >= GOAL:
        return "met"
    if sigma is None or not auto.runs or not reference.runs:
        return "below"
    upper = ratio * math.exp(1.96 * sigma * math.sqrt(1 / len(auto.runs) + 1 / len(reference.runs)))
    return "within noise" if upper >= GOAL else "below"


def interval_text(p: SweepPoint, reference: SweepPoint | None) -> str:
    """`paired_interval` of p against the reference as "0.99x (0.97-1.01)"; "-" under two rounds."""
    interval = paired_interval(p.runs, reference.runs if reference else None)
    return "-" if interval is None else "{:.2f}x ({:.2f}-{:.2f})".format(*interval)
