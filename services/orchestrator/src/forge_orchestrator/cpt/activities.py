"""Activity of the ``cpt`` workflow: its report, as files and in MLflow.

``cpt_report`` writes ``<report_dir>/<workflow id>/summary.json``, ``mixture.md`` and
``mixture.png`` (:mod:`forge_experiments.cptreport`) and, with a tracker, records the workflow as a
parent run (found again by the workflow id: a retried activity reuses it) with the mixture
curve as metrics (one step per curve row), the chosen point, the rule and the search space as
params, the three files as artifacts under ``cpt/``, and the child sweeps' parent runs filed
under it (MLflow's ``mlflow.parentRunId``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio import activity

from forge_experiments import cptreport
from forge_orchestrator.tracking.tracker import PARENT_TAG, TAG_ROLE, TAG_WORKFLOW, Tracker

CURVE_METRICS = (
    "general_fraction",
    "lr",
    "steps",
    "domain_loss",
    "general_loss",
    "domain_gain",
    "forgetting",
)


@dataclass
class ReportInput:
    workflow_id: str
    out_dir: str
    summary: dict[str, Any]
    params: dict[str, str] = field(default_factory=dict)
    sweep_runs: list[str] = field(default_factory=list)
    """MLflow parent runs of the child sweeps (empty ids are skipped)."""
    time_ms: int = 0
    """The metrics' timestamp (the workflow's clock), so a retried activity logs nothing twice."""


@dataclass
class ReportOutput:
    markdown: str
    png: str
    json: str
    run_id: str = ""
    run_url: str = ""


def write_files(out: Path, summary: dict[str, Any]) -> tuple[Path, Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    md, png = cptreport.write(summary, out)
    return md, png, path


class CptActivities:
    """The report activity; ``tracker`` None: no MLflow (files only)."""

    def __init__(self, tracker: Tracker | None) -> None:
        self._tracker = tracker

    def methods(self) -> list[Any]:
        return [self.report]

    def _track(self, params: ReportInput, files: tuple[Path, Path, Path]) -> tuple[str, str]:
        tracker = self._tracker
        assert tracker is not None
        summary = params.summary
        run_id = tracker.ensure_sweep_run(params.workflow_id, f"cpt {params.workflow_id}", params.params)
        stamp = params.time_ms or None
        tracker.set_tags(run_id, {TAG_ROLE: "sweep", TAG_WORKFLOW: params.workflow_id, "forge.kind": "cpt"})
        for step, row in enumerate(summary.get("curve", [])):
            values = {k: float(row[k]) for k in CURVE_METRICS if k in row}
            tracker.log_metrics(run_id, step, values, timestamp_ms=stamp)
        chosen = summary.get("chosen") or {}
        tracker.log_metrics(
            run_id,
            0,
            {f"chosen_{k}": float(chosen[k]) for k in CURVE_METRICS if k in chosen},
            timestamp_ms=stamp,
        )
        tracker.log_params(
            run_id, {"outcome": summary.get("outcome", ""), "reason": summary.get("reason", "")}
        )
        for path in files:
            tracker.log_artifact(run_id, path, "cpt")
        for sweep_run in params.sweep_runs:
            if sweep_run:
                tracker.set_tags(sweep_run, {PARENT_TAG: run_id})
        tracker.set_terminated(run_id, "FINISHED")
        return run_id, tracker.run_url(run_id)

    @activity.defn(name="cpt_report")
    async def report(self, params: ReportInput) -> ReportOutput:
        """Write the report files and, with a tracker, the MLflow run (idempotent)."""
        out = Path(params.out_dir) / params.workflow_id
        files = await asyncio.to_thread(write_files, out, params.summary)
        run_id = url = ""
        if self._tracker is not None:
            run_id, url = await asyncio.to_thread(self._track, params, files)
        md, png, js = files
        return ReportOutput(str(md), str(png), str(js), run_id, url)
