"""The main job's ``sweep`` step (order 90, the last: the steps before it watch the train step's
canary window, which a sweep in between would let pass without traffic): a small ASHA sweep end
to end.

Six trials of the tiny pre-training recipe (learning rate × width, 45 steps each, rungs at 5 and
15 steps) go through the real ``sweep`` workflow: the orchestrator checks the space, the trials
are preemptible scheduler jobs the trainer agents run, their ``val_loss`` comes back through Kafka
to the orchestrator's metrics consumer, and ASHA (η = 3) cancels the trials that fall out of the
top third at a rung. The step's table shows each trial's state (``stopped`` at which step, or
``completed`` with its final value), the winner, and the sweep's MLflow parent run (whose children
are the trials' runs) when the platform runs a tracking server.

It needs ``ctx.endpoint("orchestrator")`` and, for the link, ``ctx.mlflow_url``.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from forge.orchestrator.v1 import orchestrator_pb2

from forge_kit.mainjob import MainJobContext
from forge_kit.orchestrator_client import OrchestratorClient, response_to_dict, status_name
from forge_orchestrator.tracking.tracker import Tracker

#: The train step's team: its quota (set by that step) covers the two simulated GPUs of
#: ``forge up``'s agents, so the trials are placed as soon as a GPU is free.
TEAM = "main-job"

#: How long the sweep may take (six trials of 45 steps, two at a time, on a shared 2-core host;
#: 212 s measured beside a test suite, and past 240 s with a sweep benchmark beside it too).
SWEEP_WAIT_S = 600.0

#: The sweep: 3 learning rates × 2 widths, short enough for ``forge up`` and long enough for the
#: rungs to separate the trials. Warmup ends before the first rung; evaluations every 5 steps.
SPACE = """
name: main-job-asha
recipe: shakespeare_tiny
metric: {name: val_loss, mode: min}
sampler: grid
seed: 3
parameters:
  optim.lr: {type: categorical, values: [0.001, 0.004, 0.016]}
  model.hidden_size: {type: categorical, values: [64, 128]}
overrides:
  optim.warmup_steps: 2
  optim.schedule: wsd
  checkpoint.interval_steps: 0
  eval_batches: 2
  log_interval: 5
gpu_type: SIM
budget: {trials: 6, gpu_hours: 1, max_steps: 45}
concurrency: 2
team: main-job
early_stopping: {rule: asha, min_steps: 5, eta: 3}
"""


def _trial_row(trial: Mapping[str, Any]) -> str:
    params = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(trial.get("params", {}).items()))
    state = str(trial.get("state", ""))
    if state == "stopped":
        state = f"stopped at step {trial.get('stopped_at')}"
    elif state == "completed":
        state = f"completed, val_loss {float(trial.get('final') or 0.0):.3f}"
    return f"{params}: {state}"


async def sweep(ctx: MainJobContext) -> dict[str, object]:
    """Run the small sweep and show its trials, the winner and the MLflow link."""
    endpoint = ctx.endpoint("orchestrator")
    sweep_id = f"main-job-sweep-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    async with OrchestratorClient(endpoint.grpc_target, endpoint.token) as client:
        # The agents run on this machine, in this environment: a bare ``python`` is whatever the job
        # sandbox's PATH finds first, if anything.
        await client.start("sweep", {"space": SPACE, "team": TEAM, "python": sys.executable}, sweep_id)
        reply = await client.wait(sweep_id, timeout_s=SWEEP_WAIT_S)
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        raise RuntimeError(
            f"sweep {sweep_id} ended {status_name(reply.status)}: {reply.error or 'no error given'}"
        )
    result = dict(response_to_dict(reply).get("result") or {})
    trials = list(result.get("trials") or [])
    stopped = [t for t in trials if t.get("state") == "stopped"]
    completed = [t for t in trials if t.get("state") == "completed"]
    best = next((t for t in trials if t.get("index") == result.get("best_trial")), None)
    link = ""
    parent = str(result.get("parent_run_id") or "")
    uri = getattr(ctx, "mlflow_url", "")
    if uri and parent:
        link = await asyncio.to_thread(Tracker(uri).run_url, parent)
    return {
        "ok": best is not None and bool(stopped) and len(stopped) + len(completed) == len(trials),
        "sweep_id": sweep_id,
        "trials": [_trial_row(t) for t in sorted(trials, key=lambda t: int(t.get("index", 0)))],
        "stopped_early": len(stopped),
        "completed": len(completed),
        "rungs": result.get("rungs", []),
        "winner": _trial_row(best) if best else "none",
        "best_val_loss": result.get("best_metric"),
        "mlflow_url": link or "(no tracking server)",
        "elapsed_s": round(time.monotonic() - started, 1),
    }


sweep.order = 90  # type: ignore[attr-defined]
sweep.timeout_s = SWEEP_WAIT_S + 30  # type: ignore[attr-defined]
