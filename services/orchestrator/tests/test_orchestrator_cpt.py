"""The ``cpt`` workflow on the real Temporal dev server, with its real children (one ``sweep``
per replay fraction with ASHA and the real Optuna study, the ``training`` final run,
``eval_and_promote``) and the real report activity (files, matplotlib). As in the sweep's tests
no scheduler runs the jobs: a driver sends each job's events, metrics and checkpoint as the Kafka
consumers would. The eval service is a recording stand-in that scores every registered
checkpoint on 60 documents per suite from a known truth (shared per-document difficulty, a
shift per replay fraction and peak LR, small noise) and compares runs with the kit's paired
bootstrap, as eval's CompareRuns does.

Paths: the search stops a run early, the rule picks the mixture and the checkpoint and the final
run is handed to eval-and-promote; where promotions roll replicas every measurement runs on a
deployment of its checkpoint (a recording stand-in of the promotion activities), undeployed once
its runs ended, and replicas that are never ready fail the workflow; a rule nothing meets ends
the workflow with the reason and no final run; bad inputs are refused through the API's start
path naming the field.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.worker import Worker

from forge_experiments import cptmix
from forge_kit import errors, stats
from forge_kit.testing import MlflowServer, TemporalDevServer, eventually
from forge_orchestrator.activities import CancelJobInput, SubmitJobInput
from forge_orchestrator.cpt.activities import CptActivities, ReportInput
from forge_orchestrator.cpt.workflow import CptWorkflow
from forge_orchestrator.deploy.promotion import Drained, PromotionActivities, Served, ServeInput
from forge_orchestrator.eval_activities import (
    Comparison,
    ModelId,
    PromoteInput,
    RegisterInput,
    RunInput,
    RunState,
)
from forge_orchestrator.identity import Caller
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.promote.canary_activities import CanaryActivities
from forge_orchestrator.promote.workflow import EvalAndPromoteWorkflow
from forge_orchestrator.service import OrchestratorService
from forge_orchestrator.sweep.activities import SweepActivities
from forge_orchestrator.sweep.workflow import METRIC_SIGNAL, SweepWorkflow, TrialMetric
from forge_orchestrator.tracking.tracker import PARENT_TAG, Tracker
from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo
from forge_orchestrator.training.workflow import TrainWorkflow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DOCS = 60
BASE = {"scifact_ppl": 2.0, "tinyshakespeare_ppl": 1.5}


def truth(fraction: float, lr: float, steps: int) -> tuple[float, float]:
    """(domain gain, forgetting) in bits per byte: more replay forgets less and gains less, a
    higher peak LR does more of both, the full budget gains a fifth more."""
    scale = lr / 1e-3
    gain = 0.3 * (1 - fraction) * scale**0.5 * (1.2 if steps > 3 else 1.0)
    return gain, 0.12 * scale * (1 - 3 * fraction)


class FakeScheduler:
    def __init__(self) -> None:
        self.submitted: dict[str, SubmitJobInput] = {}
        self.cancelled: list[str] = []

    @activity.defn(name="ensure_team")
    async def ensure_team(self, team: str) -> bool:
        return False

    @activity.defn(name="submit_job")
    async def submit_job(self, params: SubmitJobInput) -> str:
        job_id = f"job-{len(self.submitted)}"
        for known, sub in self.submitted.items():
            if sub.request_id == params.request_id:
                return known
        self.submitted[job_id] = params
        return job_id

    @activity.defn(name="cancel_job")
    async def cancel_job(self, params: CancelJobInput) -> str:
        self.cancelled.append(params.job_id)
        return "CANCELLED"


def overrides_of(sub: SubmitJobInput) -> dict[str, str]:
    sets = [sub.command[i + 1] for i, arg in enumerate(sub.command) if arg == "--set"]
    return dict(item.split("=", 1) for item in sets)


class RecordingEval:
    """Eval's registry, runs and comparisons for the workflow's activities (names and types as
    :class:`forge_orchestrator.eval_activities.EvalActivities`)."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        self.scheduler = scheduler
        self.models: dict[str, str] = {}
        self.runs: dict[str, np.ndarray] = {}
        self.promoted: list[tuple[str, str]] = []
        self.deployments: RecordingDeployments | None = None
        self.on_replicas: list[bool] = []
        rng = np.random.default_rng(1)
        self.difficulty = {s: rng.normal(0, 0.3, DOCS) for s in BASE}

    def _scores(self, model: ModelId, suite: str) -> np.ndarray:
        uri = self.models[str(model)]
        shift = 0.0
        if uri.startswith("/ckpt/"):
            over = overrides_of(self.scheduler.submitted[uri.removeprefix("/ckpt/")])
            gain, forgetting = truth(
                float(over["mixture.general_fraction"]), float(over["optim.lr"]), int(over["max_steps"])
            )
            shift = -gain if suite == "scifact_ppl" else forgetting
        rng = np.random.default_rng(abs(hash((uri, suite))) % 2**32)
        return BASE[suite] + self.difficulty[suite] + shift + rng.normal(0, 0.01, DOCS)

    @activity.defn(name="eval_register_model")
    async def register_model(self, params: RegisterInput) -> bool:
        fresh = str(params.model) not in self.models
        self.models.setdefault(str(params.model), params.uri)
        return fresh

    @activity.defn(name="eval_current_model")
    async def current_model(self, stage: str) -> ModelId | None:
        return None

    @activity.defn(name="eval_run_suite")
    async def run_suite(self, params: RunInput) -> str:
        assert params.limit == 20
        on_replicas = not params.serve_model
        if on_replicas:  # the run scores a live deployment through the gateway
            assert self.deployments is not None and str(params.model) in self.deployments.live
        self.on_replicas.append(on_replicas)
        run_id = f"run-{len(self.runs)}"
        self.runs[run_id] = self._scores(params.model, params.suite)
        return run_id

    @activity.defn(name="eval_get_run")
    async def get_run(self, run_id: str) -> RunState:
        est = stats.mean_estimate(self.runs[run_id].tolist())
        return RunState(
            run_id, "SUCCEEDED", metrics={"bits_per_byte": est.value},
            intervals={"bits_per_byte": [est.ci_low, est.ci_high]},
        )  # fmt: skip

    @activity.defn(name="eval_compare_runs")
    async def compare_runs(self, baseline_run_id: str, candidate_run_id: str) -> Comparison:
        r = stats.paired_compare(self.runs[baseline_run_id].tolist(), self.runs[candidate_run_id].tolist())
        return Comparison(
            "NO_DIFFERENCE", deltas={"bits_per_byte": r.delta}, p_values={"bits_per_byte": r.p_value},
            intervals={"bits_per_byte": [r.ci_low, r.ci_high]},
        )  # fmt: skip

    @activity.defn(name="eval_promote_model")
    async def promote_model(self, params: PromoteInput) -> str:
        self.promoted.append((str(params.model), params.stage))
        return ""

    def methods(self) -> list[Any]:
        return [self.register_model, self.current_model, self.run_suite, self.get_run, self.compare_runs,
                self.promote_model]  # fmt: skip


class RecordingDeployments:
    """The promotion activities (names and types as :class:`PromotionActivities`) over a record:
    each version's deployment, ready at once or never."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.live: dict[str, str] = {}
        self.made: list[str] = []
        self.drained: list[str] = []

    def _why(self) -> str:
        return "" if self.ready else "no node has room"

    @activity.defn(name="promotion_serve")
    async def serve(self, params: ServeInput) -> Served:
        if params.model in self.live:
            return Served(self.live[params.model], self.ready, self._why(), 0.5)
        self.live[params.model] = f"d{len(self.made)}"
        self.made.append(params.model)
        return Served(self.live[params.model], self.ready, self._why(), 0.5, created=True)

    @activity.defn(name="promotion_status")
    async def status(self, deployment: str) -> Served:
        return Served(deployment, self.ready, self._why(), 0.5)

    @activity.defn(name="promotion_routed")
    async def routed(self, model: str) -> bool:
        return False

    @activity.defn(name="promotion_drain")
    async def drain(self, model: str) -> Drained:
        name = self.live.pop(model, None)
        if name is None:
            return Drained()
        self.drained.append(model)
        return Drained([name])

    def methods(self) -> list[Any]:
        return [self.serve, self.status, self.routed, self.drain]


async def drive(client: Client, scheduler: FakeScheduler, stop: asyncio.Event) -> None:
    """Run every submitted job: RUNNING, a search run's val_loss at each step (waiting until its
    sweep took each in), SUCCEEDED and its checkpoint — unless the sweep cancelled it."""
    done: set[str] = set()
    while not stop.is_set():
        for job_id, sub in list(scheduler.submitted.items()):
            if job_id in done:
                continue
            done.add(job_id)
            handle = client.get_workflow_handle(sub.labels.get("workflow_id") or sub.workflow_id)
            await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job_id, "RUNNING", event_id=uuid.uuid4().hex))
            over = overrides_of(sub)
            steps = int(over["max_steps"])
            if "sweep_id" in sub.labels:
                fraction, lr = float(over["mixture.general_fraction"]), float(over["optim.lr"])
                for step in range(1, steps + 1):
                    # At f=0.25 the higher peak LR is worse at the first rung: ASHA stops it.
                    value = 3.0 - 0.1 * step - (0.0 if (fraction, lr) == (0.25, 3e-3) else 0.05 * lr / 1e-3)
                    await handle.signal(METRIC_SIGNAL, TrialMetric(job_id, step, value, uuid.uuid4().hex))
                    await _taken(handle, sub.labels["trial"], step)
                    if job_id in scheduler.cancelled:
                        break
                if job_id in scheduler.cancelled:
                    continue
            await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job_id, "SUCCEEDED", event_id=uuid.uuid4().hex))
            checkpoint = CheckpointInfo(job_id, job_id, steps, f"/ckpt/{job_id}", event_id=uuid.uuid4().hex)
            await handle.signal(CHECKPOINT_SIGNAL, checkpoint)
        await asyncio.sleep(0.1)


async def _taken(handle: WorkflowHandle[Any, Any], trial: str, step: int) -> None:
    async def taken() -> bool:
        t = (await handle.query(PROGRESS_QUERY))["trials"][int(trial)]
        return any(s >= step for s, _ in t["values"]) or t["state"] not in ("pending", "running")

    await eventually(taken, what=f"trial {trial} to take step {step}")


def cpt_input(tmp_path: Path, **rule: Any) -> dict[str, Any]:
    return {
        "base": "/models/base",
        "token_budget": 12 * 64 * 9,  # 9 steps of the recipe's 12 x 64-token batches
        "search_fraction": 0.34,  # 3-step search runs, ASHA's rung at step 1
        "search": {"general_fractions": [0.05, 0.25], "peak_lrs": [1e-3, 3e-3], "min_lr": 1e-5},
        "rule": {"max_forgetting": 0.06, **rule},
        "overrides": {"eval_batches": "4"},
        "eval_limit": 20,
        "eval_poll_s": 0.1,
        "checkpoint_wait_s": 30,
        "report_dir": str(tmp_path / "reports"),
    }


def worker_for(
    client: Client,
    queue: str,
    scheduler: FakeScheduler,
    evals: RecordingEval,
    tmp_path: Path,
    deployments: RecordingDeployments | None = None,
) -> Worker:
    sweeps = SweepActivities(f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}", None)
    promotion = deployments.methods() if deployments is not None else PromotionActivities().methods()
    return Worker(
        client,
        task_queue=queue,
        workflows=[CptWorkflow, SweepWorkflow, TrainWorkflow, EvalAndPromoteWorkflow],
        activities=[scheduler.ensure_team, scheduler.submit_job, scheduler.cancel_job, *sweeps.methods(),
                    *evals.methods(), *CptActivities(None).methods(), *CanaryActivities().methods(),
                    *promotion],
    )  # fmt: skip


async def run_cpt(
    temporal_server: TemporalDevServer,
    tmp_path: Path,
    data: dict[str, Any],
    deployments: RecordingDeployments | None = None,
) -> tuple[dict[str, Any], FakeScheduler, RecordingEval]:
    client = await Client.connect(temporal_server.target)
    queue = f"cpt-{uuid.uuid4().hex[:8]}"
    scheduler = FakeScheduler()
    evals = RecordingEval(scheduler)
    evals.deployments = deployments
    service = OrchestratorService(client, queue)
    stop = asyncio.Event()
    async with worker_for(client, queue, scheduler, evals, tmp_path, deployments):
        driver = asyncio.create_task(drive(client, scheduler, stop))
        # The API's start path: what `forge workflows start cpt --input '{…}'` sends.
        workflow_id, _ = await service.start_workflow("cpt", data)
        result = await client.get_workflow_handle(workflow_id).result()
        stop.set()
        await driver
    return result, scheduler, evals


async def test_cancelling_it_cancels_its_sweeps_and_their_jobs(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    client = await Client.connect(temporal_server.target)
    queue = f"cpt-{uuid.uuid4().hex[:8]}"
    scheduler = FakeScheduler()
    evals = RecordingEval(scheduler)
    service = OrchestratorService(client, queue)
    async with worker_for(client, queue, scheduler, evals, tmp_path):
        workflow_id, _ = await service.start_workflow("cpt", cpt_input(tmp_path))
        # Both sweeps submitted both their trials; no job ever runs.
        await eventually(
            lambda: len(scheduler.submitted) == 4, what="both sweeps to submit both their trials"
        )
        await service.cancel_workflow(workflow_id, "changed my mind")
        with pytest.raises(WorkflowFailureError):
            await client.get_workflow_handle(workflow_id).result()
        await eventually(
            lambda: sorted(scheduler.cancelled) == sorted(scheduler.submitted), what="every job cancelled"
        )
        for i in range(2):
            sweep = client.get_workflow_handle(f"{workflow_id}-f{i}")
            with pytest.raises(WorkflowFailureError):  # cancelled, once its trials are
                await sweep.result()
            assert (await sweep.describe()).status == WorkflowExecutionStatus.CANCELED
    assert sorted(scheduler.cancelled) == sorted(scheduler.submitted)


async def test_search_stops_early_the_rule_picks_the_mixture_and_checkpoint_and_hands_over(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    result, scheduler, evals = await run_cpt(temporal_server, tmp_path, cpt_input(tmp_path))
    # Search: 2 fractions x 2 peak LRs as two sweeps; ASHA stopped f=0.25 / 3e-3 at its rung.
    assert len(result["sweeps"]) == 2
    sweep_jobs = [j for j, s in scheduler.submitted.items() if "sweep_id" in s.labels]
    assert len(sweep_jobs) == 4 and len(scheduler.cancelled) == 1
    stopped = overrides_of(scheduler.submitted[scheduler.cancelled[0]])
    assert (stopped["mixture.general_fraction"], stopped["optim.lr"]) == ("0.25", "0.003")
    first = overrides_of(scheduler.submitted[sweep_jobs[0]])
    assert (
        first["max_steps"] == "3" and first["optim.warmup_steps"] == "1" and first["optim.min_lr"] == "1e-05"
    )
    assert first["init.parent"] == "/models/base" and first["data.corpus"] == "beir/scifact/corpus.jsonl"
    # Curve: the 3 completed search runs and the final run, with paired intervals near the truth.
    search = [r for r in result["curve"] if r["stage"] == "search"]
    assert [(r["general_fraction"], r["lr"]) for r in search] == [(0.05, 1e-3), (0.05, 3e-3), (0.25, 1e-3)]
    for r in search:
        gain, forgetting = truth(r["general_fraction"], r["lr"], 3)
        assert r["domain_gain_ci95"][0] <= gain + 0.01 and gain - 0.01 <= r["domain_gain_ci95"][1]
        assert r["forgetting"] == pytest.approx(forgetting, abs=0.01)
    # Mixture: only f=0.25 / 1e-3 forgets less than 0.06 (interval's upper end).
    assert result["mixture"]["general_fraction"] == 0.25 and result["mixture"]["lr"] == 1e-3
    final_jobs = [s for s in scheduler.submitted.values() if "sweep_id" not in s.labels]
    assert len(final_jobs) == 1
    final = overrides_of(final_jobs[0])
    assert (
        final["max_steps"] == "9"
        and final["mixture.general_fraction"] == "0.25"
        and final["optim.lr"] == "0.001"
    )
    assert final_jobs[0].auto_eval is False
    # Checkpoint: the final run gains most within the limit.
    assert result["outcome"] == "chosen" and result["chosen"]["stage"] == "final"
    assert "the largest domain gain" in result["reason"]
    # Hand-over: eval-and-promote of the chosen checkpoint (the first model: straight to production).
    assert result["handover"]["decision"] == "promoted"
    assert evals.promoted[-1] == (result["chosen"]["extra"]["model"], "production")
    # Report.
    md = Path(result["report"]["markdown"]).read_text()
    assert "**Chosen**" in md and Path(result["report"]["png"]).stat().st_size > 10_000
    assert Path(result["report"]["json"]).is_file()
    # No promotion serving configured: every run is on a model server eval starts.
    assert evals.on_replicas and not any(evals.on_replicas)


async def test_measurements_run_on_deployments_each_undeployed_once_its_runs_ended(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    deployments = RecordingDeployments()
    result, _, evals = await run_cpt(temporal_server, tmp_path, cpt_input(tmp_path), deployments)
    assert result["outcome"] == "chosen" and result["handover"]["decision"] == "promoted"
    # The base, the 3 completed search runs and the final run, each deployed for its two runs
    # (the run stand-in checks the deployment was live), then undeployed; the hand-over's
    # eval-and-promote deploys the chosen version again, which stays: it is in production now.
    measured = [m for m in deployments.made if m != result["chosen"]["extra"]["model"]]
    assert len(deployments.made) == 6 and len(measured) == 4
    assert all(evals.on_replicas) and len(evals.on_replicas) == 2 * 5 + 1
    assert sorted(deployments.drained) == sorted(deployments.made[:5])
    assert list(deployments.live) == [result["chosen"]["extra"]["model"]]


async def test_replicas_never_ready_fail_it_and_their_deployment_is_undeployed(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    deployments = RecordingDeployments(ready=False)
    with pytest.raises(WorkflowFailureError) as failed:
        await run_cpt(temporal_server, tmp_path, cpt_input(tmp_path), deployments)
    cause = failed.value.cause
    assert "were not ready within 0.5s: no node has room" in str(cause)
    assert deployments.made == deployments.drained and len(deployments.made) == 1 and not deployments.live


async def test_a_rule_nothing_meets_ends_with_the_reason_and_no_final_run(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    result, scheduler, evals = await run_cpt(
        temporal_server, tmp_path, cpt_input(tmp_path, max_forgetting=0.0)
    )
    assert result["outcome"] == "none_admissible" and result["chosen"] is None
    assert "no checkpoint meets the rule" in result["reason"]
    assert all("sweep_id" in s.labels for s in scheduler.submitted.values())  # no final run
    assert result["handover"] == {} and evals.promoted == []
    assert "**Nothing chosen**" in Path(result["report"]["markdown"]).read_text()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rule": {"max_forget": 0.1}}, "input.rule.max_forget"),
        ({"rule": {"bound": "mean"}}, "input.rule.bound"),
        ({"search": {"general_fractions": [1.0], "peak_lrs": [1e-3]}}, "input.search.general_fractions[0]"),
        ({"search": {"general_fractions": [0.1], "peak_lrs": "1e-3"}}, "input.search.peak_lrs"),
        ({"search": {"general_fractions": [0.1], "peak_lrs": [1e-3], "min_lr": 1e-2}}, "input.search.min_lr"),
        ({"overrides": {"init.parent": "/elsewhere"}}, "input.overrides.init.parent"),
        ({"overrides": {"optim.lrr": "1"}}, "input.overrides.optim.lrr"),
        ({"overrides": {"eval_batches": "four"}}, "input.overrides.eval_batches"),
        ({"token_budget": 0}, "input.token_budget"),
        ({"domain_corpus": "../../etc/passwd"}, "input.domain_corpus"),
        ({"general_suite": "scifact_ppl"}, "input.general_suite"),
        ({"early_stopping": "hyperband"}, "input.early_stopping"),
        ({"concurrency": 0}, "input.concurrency"),
        ({"base": ""}, "input.base"),
    ],
)
async def test_bad_inputs_are_refused_at_start_naming_the_field(
    temporal_server: TemporalDevServer, tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    client = await Client.connect(temporal_server.target)
    data = {**cpt_input(tmp_path), **change}
    with pytest.raises(errors.ValidationError) as exc:
        await OrchestratorService(client, "unused").start_workflow("cpt", data)
    assert exc.value.field == field


async def test_a_team_token_may_not_start_it(temporal_server: TemporalDevServer, tmp_path: Path) -> None:
    client = await Client.connect(temporal_server.target)
    team = Caller("research-bot", "team", "research")
    with pytest.raises(errors.PermissionDeniedError, match="cpt workflows need an admin token"):
        await OrchestratorService(client, "unused").start_workflow("cpt", cpt_input(tmp_path), caller=team)


async def test_the_report_lands_in_mlflow_with_the_curve_files_and_sweeps_under_it(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    tracker = Tracker(mlflow_server.url)
    wid = f"cpt-{uuid.uuid4().hex[:8]}"
    sweep_run = tracker.ensure_sweep_run(f"{wid}-f0", "a fraction's sweep", {})
    rng = np.random.default_rng(0)
    base = rng.normal(2.0, 0.3, 40).tolist()
    points = [
        cptmix.paired_point(
            f"search f={f}", f, 1e-3, 3, base_domain=base, domain=[x - 0.3 * (1 - f) for x in base],
            base_general=base, general=[x + 0.1 * (1 - 3 * f) + rng.normal(0, 0.01) for x in base],
        )
        for f in (0.05, 0.25)
    ]  # fmt: skip
    summary = cptmix.summary(
        points, cptmix.Rule(max_forgetting=0.06), {"label": "base"}, units="bits per byte"
    )
    params = ReportInput(
        wid, str(tmp_path / "reports"), summary, {"base": "/models/base"}, [sweep_run, ""], 1_700_000_000_000
    )
    out = await CptActivities(tracker).report(params)
    again = await CptActivities(tracker).report(params)  # a retried activity: the same run
    assert out.run_id and again.run_id == out.run_id and out.run_url.endswith(out.run_id)
    run = tracker.get_run(out.run_id)
    assert run.status == "FINISHED" and run.params["base"] == "/models/base"
    assert run.params["outcome"] == "chosen" and "f=0.25" in run.params["reason"]
    assert sorted(tracker.list_artifacts(out.run_id, "cpt")) == [
        "cpt/mixture.md",
        "cpt/mixture.png",
        "cpt/summary.json",
    ]
    gains = tracker.metric_history(out.run_id, "domain_gain")
    assert [step for step, _ in gains] == [0, 1] and gains[1][1] == pytest.approx(0.225, abs=1e-6)
    assert tracker.get_run(sweep_run).tags[PARENT_TAG] == out.run_id
    assert Path(out.markdown).parent == tmp_path / "reports" / wid
