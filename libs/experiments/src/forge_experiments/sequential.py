"""Sequential comparison of two rates that may be looked at after every batch: the mixture
sequential probability ratio test (mSPRT) and its always-valid p-values.

Method (Robbins 1970; Johari, Koomen, Pekelis & Walsh 2017, "Peeking at A/B tests: why it matters,
and what to do about it", KDD; Johari, Pekelis & Walsh 2015, "Always valid inference"): with
``theta`` the difference of the two arms' means and its estimate ``d`` of variance ``V`` (normal
approximation), the likelihood ratio of ``theta = theta0 + delta`` against ``theta = theta0``,
mixed over a normal prior ``delta ~ N(0, tau^2)``, is

    Lambda = sqrt(V / (V + tau^2)) * exp(tau^2 (d - theta0)^2 / (2 V (V + tau^2)))

Under ``theta = theta0`` it is a nonnegative martingale with mean 1, so by Ville's inequality the
chance that it *ever* reaches ``1/alpha`` is at most ``alpha``, however often it is looked at. The
always-valid p-value after ``n`` looks is ``min(1, min_k 1/Lambda_k)``. A one-sided decision
(only ``d > theta0``, or only ``d < theta0``) that rejects when the p-value falls below ``alpha``
keeps the same bound.

Two tests make a canary decision per metric (a rate: errors, requests over production's p95 …),
``theta = canary - production``:

* **harm**: ``H0: theta = harm_margin`` rejected upwards: the canary is worse (rollback);
* **non-inferiority**: ``H0: theta = margin`` rejected downwards: the canary is not worse by
  ``margin`` or more (promote, once every metric says so).

``V`` for the harm test uses the pooled rate (the arms' common rate under ``H0``); for
non-inferiority each arm's own rate. Rates are smoothed (``(k + 0.5) / (n + 1)``) so an arm with no
event yet still has a variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Arm:
    """Events ``k`` out of ``n`` trials of one arm (errors out of requests …)."""

    n: int
    k: int

    def __post_init__(self) -> None:
        if self.n < 0 or self.k < 0 or self.k > self.n:
            raise ValueError(f"an arm needs 0 <= k <= n, got k={self.k}, n={self.n}")

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def smoothed(self) -> float:
        return (self.k + 0.5) / (self.n + 1)


def mixture_lr(d: float, variance: float, theta0: float, tau: float) -> float:
    """``Lambda`` of the module docstring; 1 (no evidence) when there is no variance yet."""
    if variance <= 0 or tau <= 0:
        return 1.0
    tau2 = tau * tau
    exponent = tau2 * (d - theta0) ** 2 / (2 * variance * (variance + tau2))
    # Capped: beyond e^700 every threshold is long passed.
    return math.sqrt(variance / (variance + tau2)) * math.exp(min(exponent, 700.0))


@dataclass(frozen=True)
class RateTest:
    """Both one-sided tests of one metric after one look (:func:`compare_rates`)."""

    diff: float
    """canary rate - production rate"""
    harm_lr: float
    harm_p: float
    """Always-valid p-value of "not worse than ``harm_margin``" (small: the canary is worse)."""
    noninf_lr: float
    noninf_p: float
    """Always-valid p-value of "worse by ``margin``" (small: the canary is not worse)."""


def compare_rates(
    canary: Arm,
    production: Arm,
    *,
    margin: float,
    harm_margin: float = 0.0,
    tau: float,
    previous: tuple[float, float] = (1.0, 1.0),
) -> RateTest:
    """One look at a metric: ``previous`` are the always-valid p-values ``(harm, noninf)`` of the
    earlier looks (each p-value only falls)."""
    if canary.n == 0 or production.n == 0:
        return RateTest(0.0, 1.0, previous[0], 1.0, previous[1])
    d = canary.rate - production.rate
    pooled = (canary.k + production.k + 0.5) / (canary.n + production.n + 1)
    v_pooled = pooled * (1 - pooled) * (1 / canary.n + 1 / production.n)
    c, p = canary.smoothed, production.smoothed
    v_arms = c * (1 - c) / canary.n + p * (1 - p) / production.n
    harm_lr = mixture_lr(d, v_pooled, harm_margin, tau) if d > harm_margin else 1.0
    noninf_lr = mixture_lr(d, v_arms, margin, tau) if d < margin else 1.0
    return RateTest(
        diff=d,
        harm_lr=harm_lr,
        harm_p=min(previous[0], 1.0 / harm_lr),
        noninf_lr=noninf_lr,
        noninf_p=min(previous[1], 1.0 / noninf_lr),
    )
