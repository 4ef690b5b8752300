"""How far a sweep's rungs could be trusted, from what the sweep saw (:func:`rung_trust`): rank
correlations between rung and final values, the curves' evaluation noise, and the stops taken
within that noise. Pure Python (a Temporal workflow's state reports it; rungs hold at most a few
thousand trials)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from forge_experiments.earlystop import Mode


def _ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their places)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0
        i = j + 1
    return out


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-b of paired values (NaN under 2 pairs or with a constant side). Pure Python:
    a workflow's rule calls it, and rungs hold at most a few thousand trials."""
    n = len(xs)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator > 0 else math.nan


def spearman_rho(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ of paired values (NaN under 2 pairs or with a constant side)."""
    if len(xs) < 2:
        return math.nan
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def curve_noise(curves: list[list[tuple[int, float]]]) -> float:
    """The evaluation noise the curves show: per curve, the root mean square of its second
    differences over ``√6`` (the standard deviation of independent noise on a locally straight
    curve; curvature only adds to it, so the estimate errs large), the median over curves with
    at least three points (0.0 when none has)."""
    per_curve: list[float] = []
    for curve in curves:
        ys = [v for _, v in curve if isinstance(v, int | float) and math.isfinite(v)]
        if len(ys) < 3:
            continue
        second = [ys[i - 1] - 2 * ys[i] + ys[i + 1] for i in range(1, len(ys) - 1)]
        per_curve.append(math.sqrt(sum(d * d for d in second) / len(second) / 6.0))
    return statistics.median(per_curve) if per_curve else 0.0


def _at(curve: list[tuple[int, float]], step: int) -> float | None:
    """A curve's value at ``step`` (the first one reported at or past it)."""
    for s, v in curve:
        if s >= step:
            return v
    return None


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def rung_trust(
    curves: dict[str, list[tuple[int, float]]],
    finals: dict[str, float],
    stopped: dict[str, int],
    rungs_: list[int],
    mode: Mode = "min",
    z: float = 2.0,
) -> dict[str, Any]:
    """How far a sweep's rungs can be trusted, from what it saw: per rung, the rank correlation
    (Spearman's ρ, Kendall's τ) between the values at the rung and the final values of the
    trials that finished (``finals``); the evaluation noise σ of the curves (:func:`curve_noise`);
    and how many of the ``stopped`` trials (trial → the rung it ended at) were, at that rung,
    within ``z · √2 · σ`` of the best value recorded there: stops the data could not justify.
    ``curves``: trial → (step, value) as the rule judged them."""
    sign = 1.0 if mode == "min" else -1.0
    sigma = curve_noise(list(curves.values()))
    margin = z * math.sqrt(2.0) * sigma
    per_rung: dict[str, Any] = {}
    for rung in rungs_:
        pairs = [(_at(curves.get(t, []), rung), f) for t, f in finals.items()]
        xs = [x for x, f in pairs if x is not None and math.isfinite(x) and math.isfinite(f)]
        ys = [f for x, f in pairs if x is not None and math.isfinite(x) and math.isfinite(f)]
        per_rung[str(rung)] = {
            "finished": len(xs),
            "spearman": _or_none(spearman_rho(xs, ys)),
            "kendall": _or_none(kendall_tau(xs, ys)),
        }
    close = 0
    for trial, rung in stopped.items():
        mine = _at(curves.get(trial, []), rung)
        there = [v for c in curves.values() if (v := _at(c, rung)) is not None and math.isfinite(v)]
        if mine is not None and there and sign * (mine - min(there, key=lambda v: sign * v)) <= margin:
            close += 1
    return {
        "noise": round(sigma, 5),
        "margin": round(margin, 5),
        "rungs": per_rung,
        "stopped": len(stopped),
        "stopped_within_noise": close,
    }
