"""Tests of differences for the ToyWorld report: Welch's and the paired t-test, the one-sample test of a gain, and
Holm's correction of a table of p-values. Pure functions of lists of floats (scipy.stats does the t distribution).
"""

from __future__ import annotations

import math
import statistics

from scipy import stats as _scipy_stats


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and v == v]


def _result(t: float, df: float, p: float, difference: float, se: float, n: int) -> dict:
    return {"t": t, "df": df, "p": p, "difference": difference, "se": se, "n": n}


def welch(x, y) -> dict | None:
    """Welch's two-sample t-test of mean(x) - mean(y), two-sided: t, its Welch-Satterthwaite df, p. None below 2
    values per side; p is NaN when neither side varies (no test is possible, and no verdict follows)."""
    x, y = _finite(x), _finite(y)
    if len(x) < 2 or len(y) < 2:
        return None
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    difference, se = statistics.mean(x) - statistics.mean(y), math.sqrt(vx + vy)
    if se == 0:
        return _result(math.nan, math.nan, math.nan, difference, se, len(x) + len(y))
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    t = difference / se
    return _result(t, df, _two_sided(t, df), difference, se, len(x) + len(y))


def one_sample(x) -> dict | None:
    """The t-test of mean(x) against 0, two-sided; None below 2 values."""
    x = _finite(x)
    if len(x) < 2:
        return None
    mean, se = statistics.mean(x), statistics.stdev(x) / math.sqrt(len(x))
    if se == 0:
        return _result(math.nan, math.nan, math.nan, mean, se, len(x))
    t = mean / se
    return _result(t, len(x) - 1, _two_sided(t, len(x) - 1), mean, se, len(x))


def paired(x_by_seed: dict, y_by_seed: dict) -> dict | None:
    """The paired t-test over the seeds both arms ran (same seed: same pretrained model, same rollout noise at the
    start), i.e. the one-sample test of the per-seed differences; None below 2 shared seeds."""
    shared = [s for s in x_by_seed if s in y_by_seed and x_by_seed[s] == x_by_seed[s] and y_by_seed[s] == y_by_seed[s]]
    return one_sample([x_by_seed[s] - y_by_seed[s] for s in shared])


def _two_sided(t: float, df: float) -> float:
    return float(2 * _scipy_stats.t.sf(abs(t), df))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment: the i-th smallest of m p-values times (m - i + 1), made monotone and capped at 1;
    NaN stays NaN and does not count in m. Rejecting where the adjusted p < alpha keeps the chance of any false
    verdict in the table at alpha."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if p == p)
    adjusted, running = [math.nan] * len(pvalues), 0.0
    for rank, (p, index) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[index] = running
    return adjusted
