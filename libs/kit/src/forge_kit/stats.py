"""Statistics of evaluations and experiments: means with bootstrap intervals, paired comparisons,
the Wilson interval of a proportion and percentiles.

Comparisons are paired on example ids, as both runs of a comparable spec score the same examples:
the difference of means gets a seeded paired-bootstrap interval, and its p-value comes from an
exact test — McNemar's (exact binomial on the discordant pairs) when every score is 0/1, else a
sign-flip permutation test (exact for small n, seeded Monte Carlo otherwise).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
Z95 = 1.959964
"""The standard normal's 97.5th percentile: a two-sided 95 % interval is ±``Z95`` errors."""
_CHUNK = 512


@dataclass(frozen=True)
class Estimate:
    """A mean with its bootstrap confidence interval."""

    value: float
    ci_low: float
    ci_high: float
    n: int


@dataclass(frozen=True)
class PairedResult:
    """candidate − baseline over paired examples."""

    baseline: float
    candidate: float
    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    test: str

    def summary(self) -> dict[str, Any]:
        """The figures a benchmark's summary.json reports: ``delta``, ``ci95``, ``p_value``,
        ``test``, ``n``."""
        return {
            "delta": self.delta,
            "ci95": [self.ci_low, self.ci_high],
            "p_value": self.p_value,
            "test": self.test,
            "n": self.n,
        }


def _bootstrap_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Means of ``resamples`` bootstrap resamples.

    A resample's mean depends only on how often each distinct value is drawn, so when the scores
    take few distinct values (0/1 accuracy, paired differences in {-1, 0, 1}) the counts are drawn
    from one multinomial per resample — O(resamples × distinct) instead of O(resamples × n), the
    same distribution. Otherwise indices are drawn in chunks to bound memory.
    """
    rng = np.random.default_rng(seed)
    n = len(values)
    distinct, counts = np.unique(values, return_counts=True)
    if len(distinct) <= 64:
        draws = rng.multinomial(n, counts / n, size=resamples)
        return np.asarray(draws @ distinct / n, dtype=float)
    out = np.empty(resamples)
    for start in range(0, resamples, _CHUNK):
        stop = min(resamples, start + _CHUNK)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = values[idx].mean(axis=1)
    return out


def _interval(means: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def mean_estimate(scores: Sequence[float], *, seed: int = 0, resamples: int = 1000) -> Estimate:
    """Mean of ``scores`` with a seeded percentile-bootstrap 95% interval."""
    values = np.asarray(scores, dtype=float)
    if len(values) == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    low, high = _interval(_bootstrap_means(values, resamples, seed))
    return Estimate(float(values.mean()), low, high, len(values))


def mcnemar_exact(baseline_only: int, candidate_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (binomial, p = 1/2)."""
    discordant = baseline_only + candidate_only
    if discordant == 0:
        return 1.0
    k = min(baseline_only, candidate_only)
    tail = sum(math.comb(discordant, i) for i in range(k + 1)) / 2**discordant
    return min(1.0, 2 * tail)


def sign_flip_p(differences: Sequence[float], *, seed: int = 0, resamples: int = 10_000) -> float:
    """Two-sided p-value of "mean difference is 0" by flipping signs of the paired differences.

    Exact enumeration when there are at most 16 non-zero differences, Monte Carlo otherwise
    (with the +1 correction so the p-value is never 0).
    """
    d = np.asarray([x for x in differences if x != 0], dtype=float)
    if len(d) == 0:
        return 1.0
    observed = abs(d.sum()) - 1e-12 * max(1.0, abs(d).sum())
    if len(d) <= 16:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
        return float(np.mean(np.abs(signs @ d) >= observed))
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, resamples, _CHUNK):
        size = min(_CHUNK, resamples - start)
        signs = rng.choice((1.0, -1.0), size=(size, len(d)))
        hits += int(np.sum(np.abs(signs @ d) >= observed))
    return (hits + 1) / (resamples + 1)


def standard_error(scores: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)); 0 for fewer than 2."""
    values = np.asarray(scores, dtype=float)
    if len(values) < 2:
        return 0.0
    return float(values.std(ddof=1) / math.sqrt(len(values)))


def item_means(runs: Sequence[Sequence[float]]) -> list[float]:
    """Each example's score averaged over several runs (``runs[j][i]``: run j, example i; the same
    examples in the same order), e.g. one model trained with several seeds."""
    return [sum(scores) / len(scores) for scores in zip(*runs, strict=True)]


def paired_compare(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    seed: int = 0,
    resamples: int = 2000,
    confidence: float = CONFIDENCE,
) -> PairedResult:
    """Compare two runs' scores on the same examples (``baseline[i]`` pairs with ``candidate[i]``);
    the interval of the difference is at ``confidence`` (raise it to account for many comparisons)."""
    if len(baseline) != len(candidate):
        raise ValueError("paired scores must have the same length")
    b = np.asarray(baseline, dtype=float)
    c = np.asarray(candidate, dtype=float)
    n = len(b)
    if n == 0:
        return PairedResult(math.nan, math.nan, math.nan, math.nan, math.nan, 1.0, 0, "none")
    d = c - b
    low, high = _interval(_bootstrap_means(d, resamples, seed), confidence)
    binary = bool(np.all(np.isin(b, (0.0, 1.0))) and np.all(np.isin(c, (0.0, 1.0))))
    if binary:
        p = mcnemar_exact(int(np.sum((b == 1) & (c == 0))), int(np.sum((b == 0) & (c == 1))))
        test = "mcnemar"
    else:
        p = sign_flip_p(d.tolist(), seed=seed)
        test = "sign-flip"
    return PairedResult(float(b.mean()), float(c.mean()), float(d.mean()), low, high, p, n, test)


def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for the default ``z``), sensible
    for small ``n`` unlike the normal one. ``successes`` may be fractional (a tie counted as half a
    success) and so may ``n`` (counts summed across processes).

    With no trials nothing is known: the interval is the whole of [0, 1] — the limit of the
    formula as ``n`` goes to 0, and the answer under which no threshold is wrongly met.
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n * (1 + 1e-9):  # sums of floats may overshoot n by a rounding
        raise ValueError(f"successes must be between 0 and n; got {successes=} {n=}")
    p = min(1.0, successes / n)
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def percentile(values: Sequence[float], q: float, *, empty: float = 0.0) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly between the closest
    ranks (numpy's default); ``empty`` when there are no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100; got {q}")
    if len(values) == 0:
        return empty
    return float(np.percentile(np.asarray(values, dtype=float), q))
