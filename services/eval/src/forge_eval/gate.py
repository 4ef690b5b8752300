"""The release gate: paired comparisons of runs, their verdict, and the comparison with production.

A finished run passes the gate unless its comparison with the production model's latest finished
run of the same spec is WORSE (:func:`production_comparison`); a promotion to a serving stage needs
one of the model's runs to have passed it (:func:`gate_check`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from forge_eval import reports, stats
from forge_eval.scorers import SCORERS
from forge_eval.spec import RunSpec
from forge_eval.store.registry import PRODUCTION, ModelRow, holders
from forge_eval.store.runs import MetricRow, RunRow, RunStatus, example_scores, status_name
from forge_eval.tasks import load_task, shipped_tasks
from forge_kit.modelref import label

ALPHA = 0.05
#: The stage whose model's runs are the gate's baseline.
GATE_STAGE = PRODUCTION


class Verdict(enum.IntEnum):
    """A comparison's verdict (the numbers of ``forge.eval.v1.Verdict``). Runs that cannot be
    compared are refused with what differs, so :func:`verdict_of` never gives INCOMPARABLE."""

    BETTER = 1
    WORSE = 2
    NO_DIFFERENCE = 3
    INCOMPARABLE = 4


@dataclass(frozen=True)
class MetricDelta:
    """candidate − baseline for one metric."""

    name: str
    result: stats.PairedResult


@dataclass(frozen=True)
class Comparison:
    """Paired comparison of two runs and its verdict."""

    deltas: tuple[MetricDelta, ...]
    verdict: Verdict
    report_path: str = ""


def verdict_of(deltas: tuple[MetricDelta, ...], tolerance: float = 0.0) -> Verdict:
    """The release-gate rule on intervals already widened for the number of metrics (Bonferroni):
    WORSE when some metric's interval lies entirely below −``tolerance`` in its better direction,
    BETTER when none does and some lies entirely above ``tolerance``, else NO_DIFFERENCE."""
    if not deltas:
        return Verdict.NO_DIFFERENCE
    gains = [
        (d.result.ci_low, d.result.ci_high)
        if _higher_is_better(d.name)
        else (-d.result.ci_high, -d.result.ci_low)
        for d in deltas
    ]
    if any(high < -tolerance for _, high in gains):
        return Verdict.WORSE
    if any(low > tolerance for low, _ in gains):
        return Verdict.BETTER
    return Verdict.NO_DIFFERENCE


def _higher_is_better(metric: str) -> bool:
    for scorer in SCORERS.values():
        if metric in scorer.higher_is_better:
            return scorer.higher_is_better[metric]
    return True


def suite_tolerance(suite: str) -> float:
    """The suite's gate tolerance from its shipped task file; 0 for suites without one."""
    if suite not in shipped_tasks():
        return 0.0
    return load_task(suite).gate.tolerance


def compare(
    baseline: dict[str, dict[str, float]],
    candidate: dict[str, dict[str, float]],
    *,
    seed: int,
    tolerance: float = 0.0,
) -> Comparison:
    """Paired comparison per metric at confidence 1 − ALPHA/m for m metrics, and its verdict."""
    metrics = sorted(baseline.keys() & candidate.keys())
    confidence = 1 - ALPHA / max(1, len(metrics))
    deltas = []
    for metric in metrics:
        ids = sorted(baseline[metric].keys() & candidate[metric].keys())
        result = stats.paired_compare(
            [baseline[metric][i] for i in ids],
            [candidate[metric][i] for i in ids],
            seed=seed,
            confidence=confidence,
        )
        deltas.append(MetricDelta(metric, result))
    frozen = tuple(deltas)
    return Comparison(frozen, verdict_of(frozen, tolerance))


async def production_comparison(
    session: AsyncSession, run: RunRow, spec: RunSpec, scores: dict[str, dict[str, float]]
) -> tuple[ModelRow, RunRow, Comparison] | None:
    """The release gate's comparison: ``run`` against the production model's latest finished
    run of the same spec; None when there is no production model (or it is this model) or
    it has no such run, and then the gate passes."""
    holder = (await holders(session)).get(GATE_STAGE)
    if holder is None:
        return None
    production = await session.get(ModelRow, holder.model_id)
    assert production is not None
    if (production.name, production.version) == (run.model_name, run.model_version):
        return None
    candidates = (
        await session.scalars(
            sa.select(RunRow)
            .where(
                RunRow.model_name == production.name,
                RunRow.model_version == production.version,
                RunRow.suite == run.suite,
                RunRow.status == RunStatus.SUCCEEDED,
            )
            .order_by(RunRow.finished_at.desc())
        )
    ).all()
    for baseline in candidates:
        if not RunSpec.from_dict(baseline.spec).differences(spec):
            comparison = compare(
                await example_scores(session, baseline.id),
                scores,
                seed=spec.seed,
                tolerance=suite_tolerance(spec.suite),
            )
            return production, baseline, comparison
    return None


def baseline_of(found: tuple[ModelRow, RunRow, Comparison] | None) -> reports.Baseline | None:
    """A run report's baseline section from :func:`production_comparison`'s answer."""
    if found is None:
        return None
    production, run, comparison = found
    return reports.Baseline(
        label(production.name, production.version),
        run.id,
        comparison.verdict.name,
        [(d.name, d.result) for d in comparison.deltas],
    )


async def gate_check(session: AsyncSession, model: ModelRow) -> tuple[str, dict[str, Any]]:
    """The newest finished run of ``model`` that passed the release gate, or "" with the gate's
    state: the model's latest runs, and how the newest finished one compares with production."""
    runs = (
        await session.scalars(
            sa.select(RunRow)
            .where(RunRow.model_name == model.name, RunRow.model_version == model.version)
            .order_by(RunRow.created_at.desc(), RunRow.id)
        )
    ).all()
    passing = [r for r in runs if r.status == RunStatus.SUCCEEDED and r.passed_gate]
    ref = label(model.name, model.version)
    if passing:
        return passing[0].id, {}
    if not runs:
        summary = f"model {ref} has no eval runs"
    else:
        listed = "; ".join(
            f"{r.id} ({r.suite}, {r.tier}) {status_name(r.status)}"
            + (": failed the gate" if r.status == RunStatus.SUCCEEDED else f": {r.error}" if r.error else "")
            for r in runs[:5]
        )
        summary = f"model {ref} has no finished eval run that passed the gate [{listed}]"
    report: dict[str, Any] = {"model": ref, "summary": summary, "runs": [], "comparison": None}
    for run in runs[:10]:
        metrics = (await session.scalars(sa.select(MetricRow).where(MetricRow.run_id == run.id))).all()
        report["runs"].append(
            {
                "run_id": run.id,
                "suite": run.suite,
                "tier": run.tier,
                "status": status_name(run.status),
                "passed_gate": run.passed_gate,
                "error": run.error,
                "spec_hash": run.spec_hash,
                "metrics": {m.name: [m.value, m.ci_low, m.ci_high] for m in metrics},
            }
        )
    finished = next((r for r in runs if r.status == RunStatus.SUCCEEDED), None)
    if finished is not None:
        found = await production_comparison(
            session,
            finished,
            RunSpec.from_dict(finished.spec),
            await example_scores(session, finished.id),
        )
        if found is not None:
            production, baseline, comparison = found
            report["comparison"] = {
                "candidate_run_id": finished.id,
                "baseline_run_id": baseline.id,
                "production": label(production.name, production.version),
                "verdict": comparison.verdict.name,
                "deltas": {
                    d.name: {
                        "delta": d.result.delta,
                        "ci": [d.result.ci_low, d.result.ci_high],
                        "p_value": d.result.p_value,
                        "n": d.result.n,
                    }
                    for d in comparison.deltas
                },
            }
    return "", report
