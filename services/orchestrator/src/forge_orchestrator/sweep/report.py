"""A sweep's report: Markdown and two PNGs from the sweep's state (its progress or its result).

- per configuration, the mean of its completed trials' final metric over seeds with a seeded
  percentile-bootstrap 95 % interval (:func:`forge_kit.stats.mean_estimate`);
- with a baseline, every other configuration against it paired on seed (only seeds both
  completed): mean difference, paired-bootstrap 95 % interval and sign-flip p-value
  (:func:`forge_kit.stats.paired_compare`, the eval service's paired statistics);
- which factors move the metric: a one-way ANOVA per factor over completed trials (F, a
  permutation p-value and η² = between-level share of the variance; a factor with more than 8
  values is cut into quartiles);
- ``curves.png``: the metric against steps for every trial, the rungs drawn, stopped trials
  marked where they stopped; ``effects.png``: per factor, the mean at each level with its
  interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from forge_kit.stats import mean_estimate, paired_compare

MAX_LEVELS = 8


def _key(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(params.items()))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _completed(trials: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [t for t in trials if t.get("state") == "completed" and isinstance(t.get("final"), int | float)]


def configurations(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per configuration: its parameters, seeds completed, mean and 95 % interval."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    params_of: dict[str, Mapping[str, Any]] = {}
    for t in state.get("trials", []):
        key = _key(t.get("params", {}))
        groups.setdefault(key, []).append(t)
        params_of[key] = t.get("params", {})
    rows = []
    for key, trials in groups.items():
        finals = [float(t["final"]) for t in _completed(trials)]
        estimate = mean_estimate(finals, seed=0, resamples=2000)
        rows.append(
            {
                "config": key,
                "params": dict(params_of[key]),
                "trials": len(trials),
                "completed": len(finals),
                "mean": estimate.value,
                "ci_low": estimate.ci_low,
                "ci_high": estimate.ci_high,
            }
        )
    sign = 1.0 if state.get("mode", "min") == "min" else -1.0
    return sorted(rows, key=lambda r: sign * r["mean"] if not math.isnan(r["mean"]) else math.inf)


def paired_against_baseline(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every configuration against the baseline, paired on seed."""
    baseline = state.get("baseline") or {}
    if not baseline:
        return []
    by_config: dict[str, dict[Any, float]] = {}
    params_of: dict[str, Mapping[str, Any]] = {}
    for t in _completed(state.get("trials", [])):
        key = _key(t.get("params", {}))
        by_config.setdefault(key, {})[t.get("seed")] = float(t["final"])
        params_of[key] = t.get("params", {})
    base = by_config.get(_key(baseline), {})
    rows = []
    for key, finals in by_config.items():
        if key == _key(baseline):
            continue
        seeds = sorted((s for s in finals if s in base), key=str)
        result = paired_compare([base[s] for s in seeds], [finals[s] for s in seeds], seed=0)
        rows.append(
            {
                "config": key,
                "pairs": result.n,
                "delta": result.delta,
                "ci_low": result.ci_low,
                "ci_high": result.ci_high,
                "p_value": result.p_value,
            }
        )
    return sorted(rows, key=lambda r: r["delta"] if not math.isnan(r["delta"]) else math.inf)


def _levels(values: list[Any]) -> list[str]:
    distinct = sorted(set(values), key=str)
    if len(distinct) <= MAX_LEVELS or not all(isinstance(v, int | float) for v in values):
        return [_fmt(v) for v in values]
    edges = np.quantile(np.asarray(values, dtype=float), [0.25, 0.5, 0.75])
    return [f"q{int(np.searchsorted(edges, float(v), side='right')) + 1}" for v in values]


def _f_statistic(values: np.ndarray, labels: np.ndarray) -> float:
    """One-way ANOVA F of ``values`` grouped by ``labels`` (NaN without within-group spread)."""
    groups = [values[labels == g] for g in np.unique(labels)]
    k, n = len(groups), len(values)
    between = sum(len(g) * (g.mean() - values.mean()) ** 2 for g in groups) / (k - 1)
    within = sum(((g - g.mean()) ** 2).sum() for g in groups) / (n - k)
    return float(between / within) if within > 0 else math.nan


def factor_effects(state: Mapping[str, Any], *, resamples: int = 2000) -> list[dict[str, Any]]:
    """Per factor: one-way ANOVA over completed trials (F, its permutation p-value — labels
    shuffled ``resamples`` times, seeded — and η²), and each level's mean with its interval."""
    done = _completed(state.get("trials", []))
    if not done:
        return []
    finals = np.asarray([float(t["final"]) for t in done])
    total = float(((finals - finals.mean()) ** 2).sum())
    rng = np.random.default_rng(0)
    out = []
    for factor in sorted({k for t in done for k in t.get("params", {})}):
        labels = np.asarray(_levels([t["params"].get(factor) for t in done]))
        groups: dict[str, list[float]] = {}
        for label, value in zip(labels, finals, strict=True):
            groups.setdefault(str(label), []).append(float(value))
        between = sum(len(v) * (np.mean(v) - finals.mean()) ** 2 for v in groups.values())
        f_stat = p_value = math.nan
        if 1 < len(groups) < len(finals):
            f_stat = _f_statistic(finals, labels)
            if not math.isnan(f_stat):
                shuffled = [_f_statistic(finals, rng.permutation(labels)) for _ in range(resamples)]
                hits = sum(1 for f in shuffled if not math.isnan(f) and f >= f_stat - 1e-12)
                p_value = (hits + 1) / (resamples + 1)
        levels = []
        for label, values in sorted(groups.items()):
            estimate = mean_estimate(values, seed=0, resamples=2000)
            levels.append(
                {
                    "level": label,
                    "n": len(values),
                    "mean": estimate.value,
                    "ci_low": estimate.ci_low,
                    "ci_high": estimate.ci_high,
                }
            )
        out.append(
            {
                "factor": factor,
                "levels": levels,
                "f": f_stat,
                "p_value": p_value,
                "eta_squared": float(between / total) if total > 0 else 0.0,
            }
        )
    return sorted(out, key=lambda r: -r["eta_squared"])


def _plot_curves(state: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for t in state.get("trials", []):
        values = t.get("values") or []
        if not values:
            continue
        steps, ys = [v[0] for v in values], [v[1] for v in values]
        stopped = t.get("state") == "stopped"
        ax.plot(steps, ys, alpha=0.5 if stopped else 0.9, linewidth=1.0 if stopped else 1.6, label=None)
        if stopped:
            ax.plot(steps[-1], ys[-1], "x", color="black", markersize=6)
    for rung in state.get("rungs", []):
        ax.axvline(float(rung), color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step (budget)")
    ax.set_ylabel(str(state.get("metric", "metric")))
    ax.set_title(f"{state.get('name', 'sweep')}: metric vs budget per trial (rungs dotted, x = stopped)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_effects(effects: list[dict[str, Any]], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = max(1, len(effects))
    fig, axes = plt.subplots(1, count, figsize=(4 * count, 3.6), squeeze=False)
    for ax, effect in zip(axes[0], effects, strict=False):
        levels = effect["levels"]
        xs = np.arange(len(levels))
        means = np.asarray([lv["mean"] for lv in levels])
        low = np.asarray([lv["ci_low"] for lv in levels])
        high = np.asarray([lv["ci_high"] for lv in levels])
        ax.errorbar(xs, means, yerr=[means - low, high - means], fmt="o", capsize=4)
        ax.set_xticks(xs, [lv["level"] for lv in levels], rotation=30, fontsize=8)
        ax.set_title(f"{effect['factor']} (η²={effect['eta_squared']:.2f})", fontsize=9)
        ax.set_ylabel(metric)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(value: Any) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


def trust_line(trust: Mapping[str, Any]) -> str:
    """One line of the rungs' trust (:func:`forge_experiments.rungtrust.rung_trust`): per rung, the rank
    correlations with the final values of the trials that finished; the stops within the noise."""
    parts = [
        f"rung {rung}: Spearman {_num(row.get('spearman'))}, Kendall {_num(row.get('kendall'))}"
        f" over {int(row.get('finished') or 0)} finished"
        for rung, row in _by_rung(trust)
    ]
    parts.append(
        f"{int(trust.get('stopped_within_noise') or 0)} of {int(trust.get('stopped') or 0)} stopped trials"
        f" within the noise of the rung's best (2·√2·σ, σ = {_num(trust.get('noise'))})"
    )
    return "; ".join(parts)


def _by_rung(trust: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The trust rows by rung, in step order (a state read back through the API may hold its
    keys in another order, and its counts as floats)."""
    rows = (trust.get("rungs") or {}).items()
    return sorted(((str(k), v) for k, v in rows), key=lambda kv: float(kv[0]))


def write_report(state: Mapping[str, Any], out: Path) -> Path:
    """Write ``report.md``, ``curves.png`` and ``effects.png`` under ``out``; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    metric = str(state.get("metric", "metric"))
    configs = configurations(state)
    paired = paired_against_baseline(state)
    effects = factor_effects(state)
    _plot_curves(state, out / "curves.png")
    _plot_effects(effects, metric, out / "effects.png")
    by_state = state.get("trials_by_state") or {}
    lines = [
        f"# Sweep {state.get('name', '')}",
        "",
        f"Metric: `{metric}` ({state.get('mode', 'min')}imised). Trials by state: "
        + ", ".join(f"{k} {int(v)}" for k, v in sorted(by_state.items())),
        f"Best: trial {state.get('best_trial')} with {_num(state.get('best_metric'))}"
        f" ({_key(state.get('best_params') or {})}). GPU-hours: {_num(state.get('gpu_hours'))}"
        f" of {_num(state.get('gpu_hours_budget'))}.",
        "",
        "## Configurations (mean over seeds, bootstrap 95 % interval)",
        "",
        "| configuration | trials | completed | mean | 95 % interval |",
        "|---|---|---|---|---|",
    ]
    for r in configs:
        lines.append(
            f"| {r['config']} | {r['trials']} | {r['completed']} | {_num(r['mean'])} | [{_num(r['ci_low'])}, {_num(r['ci_high'])}] |"
        )
    if paired:
        lines += [
            "",
            f"## Against the baseline ({_key(state.get('baseline') or {})}), paired on seed",
            "",
            "| configuration | pairs | mean difference | 95 % interval | p (sign-flip) |",
            "|---|---|---|---|---|",
        ]
        for r in paired:
            lines.append(
                f"| {r['config']} | {r['pairs']} | {_num(r['delta'])} | [{_num(r['ci_low'])}, {_num(r['ci_high'])}] | {_num(r['p_value'])} |"
            )
    trust = state.get("trust") or {}
    if trust:
        lines += [
            "",
            "## How far the rungs can be trusted",
            "",
            "Rank correlation between each rung's values and the final values of the trials that"
            " finished (a low one: the early ranking was not the final one, and trials stopped at"
            " that rung may have been good), and the stopped trials that were, when stopped, within"
            " the noise of the rung's best.",
            "",
            "| rung | finished | Spearman ρ | Kendall τ |",
            "|---|---|---|---|",
        ]
        for rung, row in _by_rung(trust):
            lines.append(
                f"| {rung} | {int(row.get('finished') or 0)} | {_num(row.get('spearman'))} | {_num(row.get('kendall'))} |"
            )
        lines += [
            "",
            f"Stopped within the noise: {int(trust.get('stopped_within_noise') or 0)} of {int(trust.get('stopped') or 0)}"
            f" (margin {_num(trust.get('margin'))}, σ = {_num(trust.get('noise'))}).",
        ]
    lines += [
        "",
        "## Factors (one-way ANOVA over completed trials; p by permutation)",
        "",
        "| factor | η² | F | p |",
        "|---|---|---|---|",
    ]
    for e in effects:
        lines.append(f"| {e['factor']} | {e['eta_squared']:.3f} | {_num(e['f'])} | {_num(e['p_value'])} |")
    lines += ["", "![metric vs budget](curves.png)", "", "![factor effects](effects.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
