"""Continual pre-training (CPT): the mixture search space, the checkpoint-selection rule, paired
measurements against the base model and the domain-gain / forgetting Pareto front.

Pure logic shared by the orchestrator's ``cpt`` workflow and ``forge bench cpt``
(:mod:`forge_training.bench.cpt`), so both search and choose alike:

- :class:`SearchSpace`: replay fractions (``mixture.general_fraction``) x peak learning rates, with
  the schedule of Ibrahim et al. 2024 ("Simple and Scalable Strategies to Continually Pre-train
  LLMs"): the rate is **re-warmed** from 0 to the peak over ``warmup_fraction`` of the run and
  **re-decayed** (cosine, or WSD) to ``min_lr``; :meth:`SearchSpace.overrides` is what a run of
  ``steps`` steps sets on the recipe.
- :class:`Point`: one evaluated checkpoint. Losses are in the evaluator's units (the eval
  service's bits per byte in the workflow, nats per token in the benchmark); ``forgetting`` is the
  general loss minus the base's and ``domain_gain`` the base's domain loss minus the checkpoint's,
  each with the 95 % interval of the **paired** difference (the same documents scored by both
  models). :func:`paired_point` builds one from per-document losses.
- :class:`Rule`: which checkpoints are admissible (forgetting at most ``max_forgetting`` and a
  domain gain of at least ``min_domain_gain``, judged on the interval's pessimistic end, or on the
  point estimates) and, among them, the one with the largest domain gain (ties: less forgetting).
- :func:`pareto_front` and :func:`select`: the chosen point is on the front of the admissible
  points; when none is admissible nothing is chosen and the reason says by how much the best
  candidate missed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from forge_kit import stats
from forge_kit.errors import ValidationError

MAX_FRACTIONS = 16
MAX_LRS = 16
MAX_POINTS = 64
SCHEDULES = ("cosine", "wsd")
BOUNDS = ("interval", "point")


def _finite(path: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationError(path, f"must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SearchSpace:
    """Replay fractions x peak learning rates, and the re-warm / re-decay schedule of every run."""

    general_fractions: tuple[float, ...]
    """Shares of each batch drawn from the general (replay) corpus, each in (0, 1)."""
    peak_lrs: tuple[float, ...]
    """Peak learning rates the schedule re-warms to, each in (0, 1]."""
    warmup_fraction: float = 0.05
    """Share of a run's steps spent re-warming from 0 to the peak (at least one step)."""
    min_lr: float = 3e-5
    """Where the rate is re-decayed to; below every peak."""
    schedule: str = "cosine"
    """``cosine`` (decay from the end of the warm-up) or ``wsd`` (constant, then the last
    ``decay_fraction`` of the run decays): the recipe's ``optim.schedule``."""

    def validate(self, path: str = "search") -> SearchSpace:
        """Self, or a :class:`ValidationError` naming the field (``search.peak_lrs[1]``)."""
        for name, values, limit in (
            ("general_fractions", self.general_fractions, MAX_FRACTIONS),
            ("peak_lrs", self.peak_lrs, MAX_LRS),
        ):
            if not 1 <= len(values) <= limit:
                raise ValidationError(f"{path}.{name}", f"must hold 1 to {limit} values, got {len(values)}")
            if len(set(values)) != len(values):
                raise ValidationError(f"{path}.{name}", "must not repeat a value")
        for i, f in enumerate(self.general_fractions):
            if not 0.0 < _finite(f"{path}.general_fractions[{i}]", f) < 1.0:
                raise ValidationError(
                    f"{path}.general_fractions[{i}]",
                    f"must be in (0, 1) (the cpt task mixes both corpora), got {f}",
                )
        for i, lr in enumerate(self.peak_lrs):
            if not 0.0 < _finite(f"{path}.peak_lrs[{i}]", lr) <= 1.0:
                raise ValidationError(f"{path}.peak_lrs[{i}]", f"must be in (0, 1], got {lr}")
        if len(self.general_fractions) * len(self.peak_lrs) > MAX_POINTS:
            raise ValidationError(path, f"fractions x learning rates must be at most {MAX_POINTS} runs")
        if not 0.0 <= _finite(f"{path}.warmup_fraction", self.warmup_fraction) <= 0.5:
            raise ValidationError(
                f"{path}.warmup_fraction", f"must be in [0, 0.5], got {self.warmup_fraction}"
            )
        if not 0.0 <= _finite(f"{path}.min_lr", self.min_lr) < min(self.peak_lrs):
            raise ValidationError(
                f"{path}.min_lr",
                f"must be >= 0 and below every peak ({min(self.peak_lrs):g}), got {self.min_lr}",
            )
        if self.schedule not in SCHEDULES:
            raise ValidationError(
                f"{path}.schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        return self

    def grid(self) -> list[tuple[float, float]]:
        """Every (general fraction, peak LR), fractions outermost, in the given order."""
        return [(f, lr) for f in self.general_fractions for lr in self.peak_lrs]

    def warmup_steps(self, steps: int) -> int:
        return max(1, round(steps * self.warmup_fraction))

    def overrides(self, steps: int) -> dict[str, int | float | str]:
        """The schedule's recipe overrides for a run of ``steps`` steps (not the budget, the
        fraction or the peak): re-warm length, re-decay floor and shape."""
        return {
            "optim.warmup_steps": self.warmup_steps(steps),
            "optim.min_lr": float(self.min_lr),
            "optim.schedule": self.schedule,
        }

    @staticmethod
    def run_overrides(general_fraction: float, lr: float) -> dict[str, int | float | str]:
        return {"mixture.general_fraction": float(general_fraction), "optim.lr": float(lr)}


def sweep_space(
    search: SearchSpace,
    general_fraction: float,
    *,
    name: str,
    recipe: str,
    steps: int,
    fixed: Mapping[str, int | float | str | bool],
    early_stopping: Mapping[str, Any],
    team: str,
    concurrency: int,
    gpu_hours: float,
    gpu_type: str = "SIM",
    gpus_per_trial: int = 1,
    priority_class: str = "preemptible",
) -> dict[str, Any]:
    """The sweep space (:mod:`forge_experiments.sweepspace`'s format) that searches the peak LRs at one
    replay fraction: the domain ``val_loss`` is its metric, so early stopping compares learning
    rates at the same fraction and never stops a run for replaying more general data."""
    return {
        "name": name,
        "recipe": recipe,
        "metric": {"name": "val_loss", "mode": "min"},
        "sampler": "grid",
        "parameters": {"optim.lr": {"type": "categorical", "values": [float(x) for x in search.peak_lrs]}},
        "overrides": {
            **fixed,
            **search.overrides(steps),
            "mixture.general_fraction": float(general_fraction),
        },
        "budget": {"trials": len(search.peak_lrs), "gpu_hours": gpu_hours, "max_steps": steps},
        "concurrency": concurrency,
        "team": team,
        "priority_class": priority_class,
        "gpus_per_trial": gpus_per_trial,
        "gpu_type": gpu_type,
        "early_stopping": dict(early_stopping),
    }


@dataclass(frozen=True)
class Rule:
    """Checkpoint selection: admissible points, then the largest domain gain among them."""

    max_forgetting: float = 0.05
    """Most forgetting allowed (general loss above the base's, in the evaluator's units)."""
    min_domain_gain: float = 0.0
    """Least domain gain required."""
    bound: str = "interval"
    """``interval``: forgetting's interval upper end and domain gain's lower end must meet the
    limits (the difference is shown, not just hoped for); ``point``: the point estimates."""

    def validate(self, path: str = "rule") -> Rule:
        if _finite(f"{path}.max_forgetting", self.max_forgetting) < 0:
            raise ValidationError(f"{path}.max_forgetting", f"must be >= 0, got {self.max_forgetting}")
        _finite(f"{path}.min_domain_gain", self.min_domain_gain)
        if self.bound not in BOUNDS:
            raise ValidationError(f"{path}.bound", f"must be one of {', '.join(BOUNDS)}, got {self.bound!r}")
        return self

    def forgetting_of(self, p: Point) -> float:
        return p.forgetting_ci95[1] if self.bound == "interval" else p.forgetting

    def gain_of(self, p: Point) -> float:
        return p.domain_gain_ci95[0] if self.bound == "interval" else p.domain_gain

    def admits(self, p: Point) -> bool:
        return self.forgetting_of(p) <= self.max_forgetting and self.gain_of(p) >= self.min_domain_gain

    def describe(self) -> str:
        judged = "the 95 % interval's pessimistic end" if self.bound == "interval" else "the point estimate"
        return (
            f"forgetting <= {self.max_forgetting:g} and domain gain >= {self.min_domain_gain:g} "
            f"(judged on {judged}), then the largest domain gain"
        )


@dataclass
class Point:
    """One evaluated checkpoint next to the base (see the module docstring for the signs)."""

    label: str
    general_fraction: float
    lr: float
    steps: int
    domain_loss: float
    domain_ci95: list[float]
    general_loss: float
    general_ci95: list[float]
    domain_gain: float
    domain_gain_ci95: list[float]
    forgetting: float
    forgetting_ci95: list[float]
    n_domain: int = 0
    n_general: int = 0
    stage: str = "search"
    """``search`` (a mixture-search run) or ``final`` (the full-budget run)."""
    uri: str = ""
    """Where the checkpoint is (a Hugging Face folder), when it was kept."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Loss:
    """A model's mean loss over a suite, with its interval."""

    value: float
    ci95: tuple[float, float]
    n: int


def paired_point(
    label: str,
    general_fraction: float,
    lr: float,
    steps: int,
    *,
    base_domain: Sequence[float],
    domain: Sequence[float],
    base_general: Sequence[float],
    general: Sequence[float],
    seed: int = 0,
    **kw: Any,
) -> Point:
    """A point from per-document (or per-window) losses of the base and the checkpoint on the same
    documents: means with bootstrap intervals, and differences with paired-bootstrap intervals."""
    d = stats.paired_compare(base_domain, domain, seed=seed)
    g = stats.paired_compare(base_general, general, seed=seed)
    dl = stats.mean_estimate(domain, seed=seed)
    gl = stats.mean_estimate(general, seed=seed)
    return Point(
        label=label,
        general_fraction=general_fraction,
        lr=lr,
        steps=steps,
        domain_loss=dl.value,
        domain_ci95=[dl.ci_low, dl.ci_high],
        general_loss=gl.value,
        general_ci95=[gl.ci_low, gl.ci_high],
        domain_gain=-d.delta,
        domain_gain_ci95=[-d.ci_high, -d.ci_low],
        forgetting=g.delta,
        forgetting_ci95=[g.ci_low, g.ci_high],
        n_domain=d.n,
        n_general=g.n,
        **kw,
    )


def compared_point(
    label: str,
    general_fraction: float,
    lr: float,
    steps: int,
    *,
    domain: Loss,
    general: Loss,
    domain_delta: tuple[float, float, float],
    general_delta: tuple[float, float, float],
    **kw: Any,
) -> Point:
    """A point from an evaluator's summaries: each suite's loss with its interval, and the paired
    comparison with the base as (checkpoint - base, interval low, interval high)."""
    dd, dlo, dhi = domain_delta
    gd, glo, ghi = general_delta
    return Point(
        label=label,
        general_fraction=general_fraction,
        lr=lr,
        steps=steps,
        domain_loss=domain.value,
        domain_ci95=list(domain.ci95),
        general_loss=general.value,
        general_ci95=list(general.ci95),
        domain_gain=-dd,
        domain_gain_ci95=[-dhi, -dlo],
        forgetting=gd,
        forgetting_ci95=[glo, ghi],
        n_domain=domain.n,
        n_general=general.n,
        **kw,
    )


def dominates(a: Point, b: Point) -> bool:
    """``a`` gains at least as much with no more forgetting, and is better in one."""
    return (
        a.domain_gain >= b.domain_gain
        and a.forgetting <= b.forgetting
        and (a.domain_gain > b.domain_gain or a.forgetting < b.forgetting)
    )


def pareto_front(points: Sequence[Point], among: Sequence[int] | None = None) -> list[int]:
    """Indexes (into ``points``) of the points no other one dominates (on the point estimates),
    optionally among ``among`` only; ordered by forgetting."""
    pool = list(range(len(points))) if among is None else list(among)
    front = [i for i in pool if not any(dominates(points[j], points[i]) for j in pool if j != i)]
    return sorted(front, key=lambda i: (points[i].forgetting, -points[i].domain_gain))


@dataclass
class Selection:
    chosen: int | None
    """Index of the chosen point; None when no point meets the rule."""
    admissible: list[int]
    front: list[int]
    """The Pareto front of all points."""
    reason: str
    rule: str


def select(points: Sequence[Point], rule: Rule) -> Selection:
    """The rule's choice (see :class:`Rule`), always on the admissible points' Pareto front."""
    for i, p in enumerate(points):
        for name in ("domain_gain", "forgetting"):
            if not math.isfinite(getattr(p, name)):
                raise ValueError(f"point {i} ({p.label}) has no {name}")
    front = pareto_front(points)
    admissible = [i for i, p in enumerate(points) if rule.admits(p)]
    if not points:
        return Selection(None, [], [], "no checkpoint was evaluated", rule.describe())
    if not admissible:
        least = min(range(len(points)), key=lambda i: rule.forgetting_of(points[i]))
        p = points[least]
        why = (
            f"no checkpoint meets the rule ({rule.describe()}): the least forgetting is "
            f"{rule.forgetting_of(p):.4f} ({p.label}, domain gain {rule.gain_of(p):.4f})"
        )
        return Selection(None, [], front, why, rule.describe())
    best_front = pareto_front(points, admissible)
    # Ties: less forgetting, then the full-budget run (more tokens behind the same figures).
    chosen = max(
        best_front, key=lambda i: (points[i].domain_gain, -points[i].forgetting, points[i].stage == "final")
    )
    p = points[chosen]
    why = (
        f"{p.label}: the largest domain gain ({p.domain_gain:.4f}, 95 % CI "
        f"[{p.domain_gain_ci95[0]:.4f}, {p.domain_gain_ci95[1]:.4f}]) of the {len(admissible)} of "
        f"{len(points)} checkpoints whose forgetting meets the rule (forgetting {p.forgetting:.4f}, "
        f"95 % CI [{p.forgetting_ci95[0]:.4f}, {p.forgetting_ci95[1]:.4f}] <= {rule.max_forgetting:g})"
    )
    return Selection(chosen, admissible, front, why, rule.describe())


def curve(points: Sequence[Point], selection: Selection | None = None) -> list[dict[str, Any]]:
    """The mixture curve's rows (by stage, then replay fraction, then peak LR), each point's
    figures plus whether it is admissible, on the front and chosen."""
    order = sorted(
        range(len(points)),
        key=lambda i: (points[i].stage != "search", points[i].general_fraction, points[i].lr),
    )
    rows = []
    for i in order:
        row = {k: v for k, v in points[i].as_dict().items() if k != "extra"}
        row.update(points[i].extra)
        if selection is not None:
            row["admissible"] = i in selection.admissible
            row["on_front"] = i in selection.front
            row["chosen"] = i == selection.chosen
        rows.append(row)
    return rows


def best_per_fraction(points: Sequence[Point]) -> dict[float, int]:
    """For each replay fraction, the index of its search point with the lowest domain loss (the
    peak LR the search keeps for that fraction)."""
    best: dict[float, int] = {}
    for i, p in enumerate(points):
        if p.stage == "search" and (
            p.general_fraction not in best or p.domain_loss < points[best[p.general_fraction]].domain_loss
        ):
            best[p.general_fraction] = i
    return best


def summary(points: Sequence[Point], rule: Rule, base: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """The report's JSON: ``base``, ``rule``, ``curve`` rows, ``front``, ``chosen`` (None when the
    rule admits no point) and ``reason``."""
    selection = select(points, rule)
    chosen = points[selection.chosen].as_dict() if selection.chosen is not None else None
    return {
        "base": dict(base),
        "rule": {**asdict(rule), "text": rule.describe()},
        "curve": curve(points, selection),
        "front": [points[i].label for i in selection.front],
        "chosen": chosen,
        "outcome": "chosen" if chosen is not None else "none_admissible",
        "reason": selection.reason,
        **extra,
    }
