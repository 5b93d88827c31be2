"""Running estimates for the cost model (engine/step_costs.py): a running mean, and a non-negative least-squares fit
over decayed moments of recent observations."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TIME_RATE = 0.2                 # how far one measured step moves the cost table
COLLINEAR = 1e-2                # a fitted term this near a combination of the terms before it is left out


def warm_rate(count: int) -> float:
    """How far the count-th observation moves a running estimate: the plain mean at first, then TIME_RATE."""
    return max(TIME_RATE, 1 / count)


def running_mean(mean: float, count: int, x: float) -> tuple[float, int]:
    """A running estimate and its count of observations, after observing x (moved by warm_rate)."""
    count += 1
    return mean + warm_rate(count) * (x - mean), count


@dataclass(slots=True)
class LinearFit:
    """seconds ~ coef . x with coef >= 0: least squares over the decayed moments [x x^T | x seconds] of the recent
    observations, taking terms in order. A term the observations do not tell apart from the terms taken before it
    keeps the price it was last fitted (0 before it ever was), and they take the rest of the time: a draft model at one
    sequence that drafts one token a step cannot tell its call's overhead e from a draft step h, and left at 0, e's
    1.9 ms went to h, which priced each draft token beyond the first at 2.9 ms, against the 0.7 ms that calls of
    several lengths had fitted; so auto drafted one token where four were faster. A term that would drive a price below
    0 (its own, or the others' as they take the rest) is left at 0. A term no recent observation had keeps its
    coefficient."""
    coef: np.ndarray
    moments: np.ndarray
    count: int = 0

    @classmethod
    def of(cls, num_terms: int) -> LinearFit:
        return cls(np.zeros(num_terms), np.zeros((num_terms, num_terms + 1)))

    def observe(self, x, seconds: float) -> None:
        self.count += 1
        rate = warm_rate(self.count)
        x = np.asarray(x, dtype=float)
        self.moments = (1 - rate) * self.moments + rate * np.outer(x, [*x, seconds])
        moments = self.moments.tolist()        # a few terms: plain floats are quicker than numpy's calls on them
        diag = [row[i] for i, row in enumerate(moments)]
        seen = [i for i, x in enumerate(diag) if x > 1e-9 * max(diag)]
        terms, fit, kept = [], [], []
        for t in seen:      # in order, each term the ones kept do not (nearly) explain, if no price goes below 0
            with_t = eliminate(moments, terms + [t])
            if with_t is None and self.coef[t] > 0:    # they explain it: it keeps its price, if they take the rest
                rest = [[*row[:-1], row[-1] - self.coef[t] * row[t]] for row in moments]
                refit = eliminate(rest, terms)
                if min(refit) >= 0:
                    moments, fit, kept = rest, refit, kept + [t]
            elif with_t is not None and min(with_t) >= 0:
                terms, fit = terms + [t], with_t
        self.coef[[t for t in seen if t not in kept]] = 0.0
        if terms:
            self.coef[terms] = fit


def eliminate(moments: list[list[float]], terms: list[int]) -> list[float] | None:
    """The least-squares coefficients of `terms` from moments [x x^T | x y] (Gaussian elimination, in order), or None
    where the last term is within COLLINEAR of a combination of the others (its pivot: what they leave of it)."""
    n = len(terms)
    rows = [[moments[i][j] for j in terms] + [moments[i][-1]] for i in terms]
    for c in range(n):
        pivot = rows[c][c]
        if pivot <= (COLLINEAR * moments[terms[c]][terms[c]] if c == n - 1 else 0.0):
            return None
        for r in range(c + 1, n):
            f = rows[r][c] / pivot
            rows[r] = [a - f * b for a, b in zip(rows[r], rows[c])]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rows[r][n] - sum(rows[r][k] * x[k] for k in range(r + 1, n))) / rows[r][r]
    return x
