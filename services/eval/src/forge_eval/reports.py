"""Markdown reports of the service's runs and comparisons, written under ``<data dir>/reports``.

A run report lists each metric with its 95% interval and the interval's width; a smoke-tier run
says so at the top, because its stratified subset makes the intervals wider than a full run's
(about √(N/n) wider for n of N examples). When production had a run of the same spec, the report
also has the paired deltas against it, which is what the release gate decided on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forge_eval.stats import PairedResult
from forge_eval.store.runs import MetricRow, RunRow
from forge_kit.modelref import label

SMOKE_NOTE = (
    "**Smoke tier**: each task's small stratified subset, for when compute is short. Intervals are "
    "wider than a full run's (about √(N/n) wider for n of N examples); a regression smaller than "
    "the interval cannot be seen."
)


@dataclass(frozen=True)
class Baseline:
    """What a run was compared with: the model, its run, the verdict and the per-metric deltas."""

    model: str
    run_id: str
    verdict: str
    deltas: Sequence[tuple[str, PairedResult]]


def _f(x: float) -> str:
    return "nan" if x != x else f"{x:.4f}"


def _deltas(deltas: Sequence[tuple[str, PairedResult]]) -> list[str]:
    lines = [
        "| metric | n | baseline | candidate | delta | interval (Bonferroni) | p |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in deltas:
        lines.append(
            f"| {name} | {r.n} | {_f(r.baseline)} | {_f(r.candidate)} | {r.delta:+.4f} | "
            f"[{r.ci_low:+.4f}, {r.ci_high:+.4f}] | {r.p_value:.4g} ({r.test}) |"
        )
    return lines


def run_report(run: RunRow, metrics: Sequence[MetricRow], baseline: Baseline | None) -> str:
    lines = [
        f"# Eval run {run.id}",
        "",
        f"- model: `{run.model_name}:{run.model_version}`",
        f"- suite: `{run.suite}`, tier: **{run.tier}**, examples: {run.example_count}",
        f"- spec hash: `{run.spec_hash}`",
        f"- release gate: {'passed' if run.passed_gate else 'FAILED'}",
        "",
    ]
    if run.tier == "smoke":
        lines += [SMOKE_NOTE, ""]
    lines += [
        "| metric | n | value | 95% interval | width |",
        "|---|---:|---:|---|---:|",
    ]
    for m in metrics:
        lines.append(
            f"| {m.name} | {m.n} | {_f(m.value)} | [{_f(m.ci_low)}, {_f(m.ci_high)}] | {_f(m.ci_high - m.ci_low)} |"
        )
    lines.append("")
    if baseline is None:
        lines.append("No production run of the same spec to compare with: the gate passes.")
    else:
        lines += [
            f"## Against production `{baseline.model}` (run {baseline.run_id}): {baseline.verdict}",
            "",
            *_deltas(baseline.deltas),
        ]
    return "\n".join(lines) + "\n"


def comparison_report(
    baseline: RunRow,
    candidate: RunRow,
    verdict: str,
    deltas: Sequence[tuple[str, PairedResult]],
    tolerance: float,
) -> str:
    lines = [
        f"# Comparison: {label(candidate.model_name, candidate.model_version)} vs "
        f"{label(baseline.model_name, baseline.model_version)}",
        "",
        f"- suite: `{candidate.suite}`, tier: **{candidate.tier}**, spec hash (baseline): `{baseline.spec_hash}`",
        f"- runs: baseline {baseline.id}, candidate {candidate.id}",
        f"- verdict: **{verdict}** (regression when an interval lies below −{tolerance:g} in the better direction)",
        "",
    ]
    if candidate.tier == "smoke":
        lines += [SMOKE_NOTE, ""]
    lines += _deltas(deltas)
    return "\n".join(lines) + "\n"
