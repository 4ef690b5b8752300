"""The sweep report from a sweep's state, the CLI refusing a bad space before any call, and the
TrainingMetrics handler sending a sweep only its followed metric."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from forge.events.v1 import events_pb2
from typer.testing import CliRunner

from forge_experiments.rungtrust import rung_trust
from forge_kit.db import Database, utcnow
from forge_orchestrator.store import JobEventRow
from forge_orchestrator.sweep.cli import app, sweep_state
from forge_orchestrator.sweep.metrics_handler import MetricsHandler
from forge_orchestrator.sweep.model import run_metrics
from forge_orchestrator.sweep.report import (
    configurations,
    factor_effects,
    paired_against_baseline,
    trust_line,
    write_report,
)
from forge_orchestrator.sweep.workflow import TrialMetric


def ablation_state() -> dict[str, Any]:
    """lr in {1e-3, 3e-3} x width in {64, 128} x seeds {1, 2, 3}: lr 3e-3 is better by exactly
    0.1 on every seed, width only adds seed noise."""
    rng = random.Random(0)
    trials = []
    seed_offset = {1: 0.0, 2: 0.05, 3: -0.03}
    index = 0
    for lr in (1e-3, 3e-3):
        for width in (64, 128):
            for seed in (1, 2, 3):
                final = (
                    2.0
                    - (0.1 if lr == 3e-3 else 0.0)
                    + seed_offset[seed]
                    + rng.uniform(-1e-3, 1e-3) * (width == 128)
                )
                trials.append(
                    {
                        "index": index,
                        "params": {"optim.lr": lr, "model.hidden_size": width},
                        "seed": seed,
                        "state": "completed",
                        "final": final,
                        "values": [[9.0, final + 1], [27.0, final + 0.3], [81.0, final]],
                    }
                )
                index += 1
    trials.append({"index": index, "params": {"optim.lr": 1e-2, "model.hidden_size": 64}, "seed": 1,
                   "state": "stopped", "final": None, "stopped_at": 9, "values": [[9.0, 4.0]]})  # fmt: skip
    return {
        "name": "abl",
        "metric": "val_loss",
        "mode": "min",
        "rungs": [9, 27],
        "baseline": {"optim.lr": 1e-3, "model.hidden_size": 64},
        "trials_by_state": {"completed": 12, "stopped": 1},
        "best_trial": 3,
        "best_metric": 1.87,
        "trials": trials,
    }


def test_configurations_paired_differences_and_factor_importance() -> None:
    state = ablation_state()
    rows = configurations(state)
    assert rows[0]["params"]["optim.lr"] == 3e-3 and rows[0]["completed"] == 3
    assert all(r["ci_low"] <= r["mean"] <= r["ci_high"] for r in rows if r["completed"])
    paired = {r["config"]: r for r in paired_against_baseline(state)}
    better = paired["model.hidden_size=64, optim.lr=0.003"]
    assert better["pairs"] == 3 and abs(better["delta"] + 0.1) < 1e-9
    assert abs(better["ci_low"] + 0.1) < 1e-9 and abs(better["ci_high"] + 0.1) < 1e-9
    same = paired["model.hidden_size=128, optim.lr=0.001"]
    assert abs(same["delta"]) < 2e-3
    effects = {e["factor"]: e for e in factor_effects(state)}
    assert effects["optim.lr"]["eta_squared"] > 0.5 > effects["model.hidden_size"]["eta_squared"]


def test_write_report_makes_markdown_and_pngs(tmp_path: Path) -> None:
    path = write_report(ablation_state(), tmp_path / "r")
    text = path.read_text()
    assert "paired on seed" in text and "| optim.lr |" in text and "curves.png" in text
    for name in ("curves.png", "effects.png"):
        assert (tmp_path / "r" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_status_and_parent_run_say_how_far_the_rungs_can_be_trusted(tmp_path: Path) -> None:
    """The trust figures of the ablation's trials (every completed one ranks at rung 27 as at the
    end: its value there is its final + 0.3, so ρ = τ = 1; the stopped one was 4.0 at rung 9,
    far behind the best there) in the report's table, in the status line and in the metrics the
    sweep's MLflow parent run is closed with."""
    state = ablation_state()
    trials = state["trials"]
    state["trust"] = rung_trust(
        {str(t["index"]): [(int(s), v) for s, v in t["values"]] for t in trials},
        {str(t["index"]): t["final"] for t in trials if t["state"] == "completed"},
        {str(t["index"]): t["stopped_at"] for t in trials if t["state"] == "stopped"},
        state["rungs"],
    )
    assert state["trust"]["rungs"]["27"] == {"finished": 12, "spearman": 1.0, "kendall": 1.0}
    text = write_report(state, tmp_path / "r").read_text()
    assert "## How far the rungs can be trusted" in text and "| 27 | 12 | 1 | 1 |" in text
    assert "Stopped within the noise: 0 of 1" in text
    line = trust_line(state["trust"])
    assert "rung 27: Spearman 1, Kendall 1 over 12 finished" in line and "0 of 1 stopped" in line
    logged = run_metrics(state)
    assert logged["rung_27_spearman"] == 1.0 and logged["rung_27_kendall"] == 1.0
    assert logged["stopped"] == 1.0 and logged["stopped_within_noise"] == 0.0
    assert logged["noise"] == state["trust"]["noise"]


def test_state_from_a_finished_sweep_result() -> None:
    view = {"workflow_type": "sweep", "status": "COMPLETED",
            "result": {"summary": {"name": "x", "best_trial": 1}, "trials": [{"index": 1}]}}  # fmt: skip
    assert sweep_state(view) == {"name": "x", "best_trial": 1, "trials": [{"index": 1}], "step": "done"}


def test_cli_refuses_a_bad_space_naming_the_field_before_calling(tmp_path: Path) -> None:
    space = tmp_path / "bad.yaml"
    space.write_text(
        "name: s\nrecipe: smoke\nmetric: {name: val_loss}\nparameters:\n"
        "  optim.lr: {type: uniform, low: 0.01, high: 0.001}\ngpu_type: SIM\nbudget: {trials: 2, gpu_hours: 1, max_steps: 9}\n"
        "team: t\nsampler: random\n"
    )
    result = CliRunner().invoke(app, ["start", str(space), "--target", "127.0.0.1:1"])
    assert result.exit_code != 0
    assert "parameters.optim.lr.high" in result.output and "empty range" in result.output


class FakeSweepSignaller:
    """Stands in for Temporal: which workflow follows which metric, and what was signalled."""

    def __init__(self, followed: dict[str, str]) -> None:
        self.followed = followed
        self.described: list[str] = []
        self.sent: list[tuple[str, TrialMetric]] = []

    async def followed_metric(self, workflow_id: str) -> str:
        self.described.append(workflow_id)
        return self.followed.get(workflow_id, "")

    async def trial_metric(self, workflow_id: str, metric: TrialMetric) -> bool:
        self.sent.append((workflow_id, metric))
        return True


async def test_metrics_handler_signals_only_a_sweeps_followed_metric(db: Database) -> None:
    signaller = FakeSweepSignaller({"sweep-1": "val_loss"})
    handler = MetricsHandler(signaller)
    async with db.session() as session:
        for job, workflow in (("j1", "sweep-1"), ("j2", "training-1")):
            session.add(
                JobEventRow(
                    event_id=f"e-{job}",
                    job_id=job,
                    workflow_id=workflow,
                    state="RUNNING",
                    received_at=utcnow(),
                )
            )
        await session.flush()

        def metrics(job: str, step: int, **values: float) -> events_pb2.TrainingMetrics:
            event = events_pb2.TrainingMetrics(job_id=job, step=step, values=values)
            event.meta.event_id = f"{job}-{step}"
            return event

        await handler.handle(metrics("j1", 10, loss=3.0), session)  # no val_loss at this step
        await handler.handle(metrics("j1", 9, loss=3.0, val_loss=2.5), session)
        await handler.handle(metrics("j2", 9, val_loss=2.0), session)  # a training workflow's job
        await handler.handle(metrics("j-unknown", 9, val_loss=1.0), session)  # no workflow started it
        # A rung's cooldown branch (its own metrics line): signalled flagged, under its own event id.
        await handler.handle(metrics("j1", 3, cooldown_val_loss=2.7, cooldown_steps=1.0), session)
        await handler.handle(metrics("j2", 3, cooldown_val_loss=2.0), session)
    assert signaller.sent == [
        ("sweep-1", TrialMetric("j1", 9, 2.5, "j1-9")),
        ("sweep-1", TrialMetric("j1", 3, 2.7, "j1-3/cooldown", cooldown=True)),
    ]
    assert sorted(signaller.described) == ["sweep-1", "training-1"]  # once each, then remembered
