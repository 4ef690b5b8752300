"""Guarded-canary analysis: a versioned policy, the gateway's metrics of a canary and of production,
and the sequential decision (promote, rollback, extend) with its evidence.

The inputs are the inference gateway's own Prometheus metrics, labelled by model version and split
(``stable``: the alias's production model, ``canary``: its canary):

* ``forge_gateway_upstream_requests_total{status}``: **errors** are 5xx, ``timeout``,
  ``unavailable`` (no replica could take the request: a crashed canary replica counts here) and
  ``broken`` streams, out of every request that reached a model (4xx, 499 and cached answers are
  not the model's doing and are left out);
* ``forge_gateway_time_to_first_token_seconds`` and ``forge_gateway_inter_token_latency_seconds``
  (histograms): **TTFT p95** and **inter-token latency p95** are compared as the share of each
  arm's requests above production's p95 bucket (production ~5 %; a canary whose p95 is higher has
  more than 5 % above it);
* ``forge_gateway_empty_answers_total``: the **online quality proxy**, the share of successful
  answers with no generated text (no rater feedback reaches the gateway, so a cheap proxy stands
  in for thumbs up/down).

Each metric is a rate compared with :func:`forge_experiments.sequential.compare_rates` (always-valid
p-values, so looking after every analysis interval costs no extra false alarms). The thresholds
live in a policy file per model family (``policies/canary/<family>.yaml``), never in code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forge_experiments.sequential import Arm, compare_rates
from forge_kit import errors
from forge_kit.latency import LATENCY_BUCKETS

METRICS = ("errors", "ttft_p95", "itl_p95", "empty_answers")
DECISIONS = ("promote", "rollback", "extend", "continue")
REQUESTS_METRIC = "forge_gateway_upstream_requests"
TTFT_METRIC = "forge_gateway_time_to_first_token_seconds"
ITL_METRIC = "forge_gateway_inter_token_latency_seconds"
EMPTY_METRIC = "forge_gateway_empty_answers"
#: The series the analysis reads (:func:`parse_metrics`), and asks Prometheus for (:func:`federation_url`).
_REQUESTS, _TTFT, _ITL, _EMPTY = SERIES = (
    f"{REQUESTS_METRIC}_total",
    f"{TTFT_METRIC}_bucket",
    f"{ITL_METRIC}_bucket",
    f"{EMPTY_METRIC}_total",
)
#: Statuses that are the model's failure; other non-2xx statuses are left out of the error rate.
ERROR_STATUSES = frozenset({"timeout", "unavailable", "broken"})
NOT_COUNTED = frozenset({"cached", "499"})
_FAMILY = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
MAX_POLICY_BYTES = 64 * 1024


class MetricPolicy(BaseModel):
    """One metric's thresholds: ``margin`` is how much worse (rate difference) a canary may be and
    still be promoted; ``harm_margin`` how much worse it must be shown to be for a rollback;
    ``tau`` the mixture prior's scale (the size of effect the test is tuned to find)."""

    model_config = ConfigDict(extra="forbid")
    margin: float = Field(gt=0, le=1)
    harm_margin: float = Field(default=0.0, ge=0, le=1)
    tau: float = Field(gt=0, le=1)


class CanaryPolicy(BaseModel):
    """A model family's canary policy (a versioned YAML file)."""

    model_config = ConfigDict(extra="forbid")
    family: str
    version: int = Field(ge=1)
    traffic_percent: int = Field(default=10, ge=1, le=100)
    """Share of the production alias's traffic the canary gets (sticky per user/session)."""
    window_s: float = Field(gt=0, le=7 * 86400)
    """Analysis window; a decision may come earlier."""
    interval_s: float = Field(gt=0, le=3600)
    """Time between looks at the metrics."""
    extension_s: float = Field(gt=0, le=86400)
    max_extensions: int = Field(default=2, ge=0, le=100)
    min_requests: int = Field(default=50, ge=1)
    """Requests each arm needs before the canary may be promoted."""
    on_inconclusive: Literal["rollback", "promote"] = "rollback"
    """What happens when the last extension ends undecided; ``rollback`` (the default) means a
    canary that got no traffic is never promoted."""
    alpha: float = Field(default=0.05, gt=0, lt=1)
    """Chance of rolling back a canary no worse than production (split over the metrics)."""
    beta: float = Field(default=0.05, gt=0, lt=1)
    """Chance of promoting a canary worse by a metric's margin (per metric)."""
    metrics: dict[Literal["errors", "ttft_p95", "itl_p95", "empty_answers"], MetricPolicy]

    def deadline_s(self, extensions: int) -> float:
        return self.window_s + extensions * self.extension_s


def policy_dir(start: Path | None = None) -> Path:
    """``policies/canary`` of the checkout this package runs from."""
    from forge_kit.paths import find_repo_root

    here = start or Path(__file__).resolve().parent
    root = find_repo_root(Path.cwd()) or find_repo_root(here) or Path.cwd()
    return root / "policies" / "canary"


def load_policy(family: str, directory: Path | None = None) -> CanaryPolicy:
    """The policy of ``family`` (``<dir>/<family>.yaml``), else ``<dir>/default.yaml``."""
    if not _FAMILY.fullmatch(family):
        raise errors.ValidationError(
            "canary_policy", "must be 1-64 of a-z, 0-9, '.', '_', '-' (starting with a letter or digit)"
        )
    folder = directory or policy_dir()
    path = folder / f"{family}.yaml"
    if not path.is_file():
        path = folder / "default.yaml"
    if not path.is_file():
        raise errors.NotFoundError(f"no canary policy {family!r} (nor default.yaml) in {folder}")
    raw = path.read_bytes()
    if len(raw) > MAX_POLICY_BYTES:
        raise errors.ValidationError("canary_policy", f"{path.name} is over {MAX_POLICY_BYTES} bytes")
    try:
        return CanaryPolicy.model_validate(yaml.safe_load(raw))
    except (yaml.YAMLError, ValidationError) as exc:
        raise errors.ValidationError("canary_policy", f"{path.name}: {exc}") from None


@dataclass
class SplitCounts:
    """One (model version, split)'s cumulative counters from the gateway's metrics."""

    statuses: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)
    """Cumulative bucket counts by upper bound (``le``)."""
    itl: dict[str, float] = field(default_factory=dict)
    empty: float = 0.0

    def minus(self, start: SplitCounts) -> SplitCounts:
        """Counts since ``start``; a counter that went down (a gateway restarted) counts from 0."""

        def sub(now: Mapping[str, float], then: Mapping[str, float]) -> dict[str, float]:
            return {k: v - then.get(k, 0.0) if v >= then.get(k, 0.0) else v for k, v in now.items()}

        empty = self.empty - start.empty if self.empty >= start.empty else self.empty
        return SplitCounts(
            sub(self.statuses, start.statuses), sub(self.ttft, start.ttft), sub(self.itl, start.itl), empty
        )

    def plus(self, other: SplitCounts) -> SplitCounts:
        def add(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}

        return SplitCounts(
            add(self.statuses, other.statuses),
            add(self.ttft, other.ttft),
            add(self.itl, other.itl),
            self.empty + other.empty,
        )

    def requests(self) -> Arm:
        """Requests that reached a model, and those among them that failed."""
        n = k = 0
        for status, count in self.statuses.items():
            if status in NOT_COUNTED or (status.isdigit() and 400 <= int(status) < 500):
                continue
            n += int(count)
            if status in ERROR_STATUSES or (status.isdigit() and int(status) >= 500):
                k += int(count)
        return Arm(n, k)

    def ok(self) -> int:
        return int(sum(v for s, v in self.statuses.items() if s.isdigit() and 200 <= int(s) < 300))


def parse_metrics(text: str, series: Iterable[tuple[str, str]]) -> dict[tuple[str, str], SplitCounts]:
    """The counters of each ``(model, split)`` in ``series`` from a Prometheus exposition, summed
    over its series: one gateway's ``/metrics``, or every replica's at once as a Prometheus
    server's federation endpoint gives them (:func:`federation_url`; each sample then carries
    its replica's ``instance`` label)."""
    wanted = {key: SplitCounts() for key in series}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.labels.get("model", ""), sample.labels.get("split", ""))
            counts = wanted.get(key)
            if counts is None:
                continue
            if sample.name == _REQUESTS:
                status = sample.labels.get("status", "")
                counts.statuses[status] = counts.statuses.get(status, 0.0) + sample.value
            elif sample.name == _TTFT:
                le = sample.labels["le"]
                counts.ttft[le] = counts.ttft.get(le, 0.0) + sample.value
            elif sample.name == _ITL:
                le = sample.labels["le"]
                counts.itl[le] = counts.itl.get(le, 0.0) + sample.value
            elif sample.name == _EMPTY:
                counts.empty += sample.value
    return wanted


def federation_url(prometheus_url: str) -> str:
    """The address of the series the analysis reads, every gateway replica's, on the Prometheus
    server at ``prometheus_url`` that scrapes them (its ``/federate`` endpoint: each series'
    latest sample, in the exposition format :func:`parse_metrics` reads)."""
    match = urlencode({"match[]": f'{{__name__=~"{"|".join(SERIES)}"}}'})
    return f"{prometheus_url.rstrip('/')}/federate?{match}"


@dataclass(frozen=True)
class Outcome:
    """One request as the gateway sees it (for replaying recorded or simulated traffic)."""

    status: str
    ttft_s: float | None = None
    itl_s: float | None = None
    empty: bool = False


def _histogram(values: list[float]) -> dict[str, float]:
    bounds = np.asarray(LATENCY_BUCKETS)
    counts = np.searchsorted(np.sort(np.asarray(values, dtype=float)), bounds, side="right")
    hist = {str(b): float(c) for b, c in zip(LATENCY_BUCKETS, counts, strict=True)}
    hist["+Inf"] = float(len(values))
    return hist


def counts_of(outcomes: Iterable[Outcome]) -> SplitCounts:
    """The counters the gateway would hold after serving ``outcomes``."""
    counts = SplitCounts()
    ttft: list[float] = []
    itl: list[float] = []
    for o in outcomes:
        counts.statuses[o.status] = counts.statuses.get(o.status, 0.0) + 1
        if o.ttft_s is not None:
            ttft.append(o.ttft_s)
        if o.itl_s is not None:
            itl.append(o.itl_s)
        counts.empty += 1.0 if o.empty and o.status == "200" else 0.0
    counts.ttft, counts.itl = (_histogram(ttft) if ttft else {}), (_histogram(itl) if itl else {})
    return counts


def _buckets(hist: Mapping[str, float]) -> list[tuple[float, float]]:
    return sorted((float(le), count) for le, count in hist.items())


def quantile_bucket(hist: Mapping[str, float], q: float) -> float | None:
    """The upper bound of the bucket holding the ``q`` quantile; None without observations."""
    buckets = _buckets(hist)
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q * total:
            return le
    return math.inf


def exceedance(hist: Mapping[str, float], bound: float) -> Arm:
    """Observations above ``bound`` (a bucket bound of the same histogram) out of all."""
    buckets = _buckets(hist)
    if not buckets:
        return Arm(0, 0)
    total = int(buckets[-1][1])
    below = max((int(c) for le, c in buckets if le <= bound), default=0)
    return Arm(total, max(0, total - below))


@dataclass
class MetricEvidence:
    canary_n: int
    canary_k: int
    production_n: int
    production_k: int
    diff: float
    harm_p: float
    noninf_p: float
    threshold_s: float | None = None
    """Production's p95 bucket bound (latency metrics)."""
    canary_p95_s: float | None = None


@dataclass
class Analysis:
    """One look's outcome: ``decision`` is ``promote``, ``rollback``, ``extend`` or ``continue``."""

    decision: str
    reason: str
    metrics: dict[str, MetricEvidence]
    elapsed_s: float
    policy: str
    """``family@version``"""

    def evidence(self) -> dict[str, Any]:
        return asdict(self)

    def p_values(self) -> dict[str, list[float]]:
        return {name: [m.harm_p, m.noninf_p] for name, m in self.metrics.items()}


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _arms(
    name: str, canary: SplitCounts, production: SplitCounts
) -> tuple[Arm, Arm, float | None, float | None]:
    if name == "errors":
        return canary.requests(), production.requests(), None, None
    if name == "empty_answers":
        return (
            Arm(canary.ok(), min(canary.ok(), int(canary.empty))),
            Arm(production.ok(), min(production.ok(), int(production.empty))),
            None,
            None,
        )
    c_hist, p_hist = (canary.ttft, production.ttft) if name == "ttft_p95" else (canary.itl, production.itl)
    bound = quantile_bucket(p_hist, 0.95)
    if bound is None:
        total = int(_buckets(c_hist)[-1][1]) if c_hist else 0
        return Arm(total, 0), Arm(0, 0), None, quantile_bucket(c_hist, 0.95)
    return exceedance(c_hist, bound), exceedance(p_hist, bound), bound, quantile_bucket(c_hist, 0.95)


def analyze(
    canary: SplitCounts,
    production: SplitCounts,
    policy: CanaryPolicy,
    *,
    elapsed_s: float,
    extensions: int,
    previous: Mapping[str, list[float]] | None = None,
    paused: bool = False,
) -> Analysis:
    """One look at the window's counts (since the canary started).

    1. per metric, both sequential tests (earlier looks' p-values carried in ``previous``);
    2. **rollback** as soon as any metric shows harm (``alpha`` split over the metrics);
    3. **promote** when each arm has ``min_requests`` and every observed metric shows
       non-inferiority (a metric neither arm has data for, e.g. latency of non-streamed traffic,
       is skipped; one only production has blocks it);
    4. otherwise **continue** until the window (with its extensions) ends, then **extend** while
       extensions are left, then the policy's ``on_inconclusive``.
    """
    previous = previous or {}
    alpha_m = policy.alpha / max(1, len(policy.metrics))
    found: dict[str, MetricEvidence] = {}
    harmed: list[str] = []
    unproven: list[str] = []
    for name, rule in policy.metrics.items():
        c_arm, p_arm, bound, c_p95 = _arms(name, canary, production)
        before = previous.get(name, [1.0, 1.0])
        test = compare_rates(
            c_arm,
            p_arm,
            margin=rule.margin,
            harm_margin=rule.harm_margin,
            tau=rule.tau,
            previous=(float(before[0]), float(before[1])),
        )
        found[name] = MetricEvidence(
            c_arm.n,
            c_arm.k,
            p_arm.n,
            p_arm.k,
            round(test.diff, 6),
            test.harm_p,
            test.noninf_p,
            _finite(bound),
            _finite(c_p95),
        )
        if test.harm_p <= alpha_m:
            harmed.append(
                f"{name} (canary {c_arm.rate:.3f} vs production {p_arm.rate:.3f}, p={test.harm_p:.2g})"
            )
        elif (c_arm.n or p_arm.n) and test.noninf_p > policy.beta:
            unproven.append(name)
    label = f"{policy.family}@{policy.version}"
    requests = found.get("errors")
    traffic = min(requests.canary_n, requests.production_n) if requests else 0
    deadline = policy.deadline_s(extensions)

    def outcome(decision: str, reason: str) -> Analysis:
        return Analysis(decision, reason, found, round(elapsed_s, 3), label)

    if harmed:
        return outcome("rollback", "canary worse than production: " + "; ".join(harmed))
    if paused:
        return outcome("continue", "paused by an operator")
    if traffic >= policy.min_requests and not unproven:
        return outcome(
            "promote", f"no worse than production on {', '.join(found)} after {traffic} requests per arm"
        )
    if elapsed_s < deadline:
        return outcome("continue", "collecting")
    if traffic < policy.min_requests:
        why = f"too little traffic: {traffic} requests per arm, {policy.min_requests} needed"
    else:
        why = f"not yet shown no worse on {', '.join(unproven)}"
    if extensions < policy.max_extensions:
        return outcome("extend", f"{why}; window extended by {policy.extension_s:g}s")
    return outcome(
        policy.on_inconclusive, f"{why} after {extensions} extension(s); policy says {policy.on_inconclusive}"
    )
