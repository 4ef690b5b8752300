"""The main job's ``tracking`` step (order 45, right after ``train``): the training run in MLflow.

The train step's job was recorded by the orchestrator's tracking consumer from the platform's
events alone; this step waits until its MLflow run is closed with its loss curve, and shows the
run's page, its params and how many steps of metrics it holds. It needs ``ctx.mlflow_url`` (the
tracking server ``forge up`` started) and ``ctx.results["train"]["job_id"]``.
"""

from __future__ import annotations

import asyncio
import time

from forge_kit.mainjob import MainJobContext
from forge_orchestrator.tracking.tracker import RunFilter, Tracker

#: How long the run may take to show up closed after the train step returned.
TRACKING_WAIT_S = 120.0
SHOWN_PARAMS = ("recipe", "overrides", "config_hash", "data_hash", "seed", "code_version")


async def tracking(ctx: MainJobContext) -> dict[str, object]:
    """Find the train step's MLflow run, wait until it is FINISHED with its plot, and show it."""
    uri = getattr(ctx, "mlflow_url", "")
    if not uri:
        raise RuntimeError("the platform runs no MLflow server (main-job context has no mlflow_url)")
    train = ctx.results.get("train")
    if not train or not train.get("job_id"):
        raise RuntimeError("the train step left no job_id to look up")
    tracker = Tracker(uri)
    job_id = str(train["job_id"])
    deadline = time.monotonic() + TRACKING_WAIT_S
    while True:
        found = await asyncio.to_thread(tracker.find_runs, RunFilter(job_id=job_id), max_results=1)
        run = found[0] if found else None
        plots = await asyncio.to_thread(tracker.list_artifacts, run.run_id, "plots") if run else []
        if run is not None and run.status == "FINISHED" and plots:
            break
        if time.monotonic() > deadline:
            state = f"status {run.status}, artifacts {plots}" if run else "no run"
            raise RuntimeError(f"job {job_id}: MLflow run not closed within {TRACKING_WAIT_S:g}s ({state})")
        await asyncio.sleep(1.0)
    losses = await asyncio.to_thread(tracker.metric_history, run.run_id, "loss")
    return {
        "ok": bool(losses),
        "mlflow_url": run.url,
        "run_id": run.run_id,
        "status": run.status,
        "loss_steps_logged": len(losses),
        "metrics": sorted(run.metrics),
        "params": {k: run.params[k] for k in SHOWN_PARAMS if k in run.params},
        "artifacts": plots + await asyncio.to_thread(tracker.list_artifacts, run.run_id, "checkpoints"),
    }


tracking.order = 45  # type: ignore[attr-defined]
tracking.timeout_s = TRACKING_WAIT_S + 30  # type: ignore[attr-defined]
