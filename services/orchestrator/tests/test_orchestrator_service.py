"""Unit tests (no network): workflow input parsing, job-event routing with the consumer's dedupe,
status translation, token resolution."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import sqlalchemy as sa
import typer
from aiokafka import ConsumerRecord
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.orchestrator.v1 import orchestrator_pb2
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from forge_kit import errors
from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.events import ProcessedEvent
from forge_kit.testing import eventkeys
from forge_orchestrator.api import view_to_proto
from forge_orchestrator.cli import resolve_token
from forge_orchestrator.event_handlers import CheckpointHandler, JobEventHandler
from forge_orchestrator.inbox import JobEvent
from forge_orchestrator.routing import AUTO_EVAL_LABEL
from forge_orchestrator.service import (
    KINDS,
    WORKFLOWS,
    OrchestratorService,
    WorkflowView,
    failure_message,
    parse_input,
)
from forge_orchestrator.smoke.model import SmokeInput
from forge_orchestrator.smoke.service import validate_smoke
from forge_orchestrator.store import JobEventRow
from forge_orchestrator.training.model import CheckpointInfo, TrainInput

TOPIC = "forge.scheduler.job_state_changed.v1"


# --- input ----------------------------------------------------------------------------------------


def test_input_defaults_and_numbers_from_a_struct() -> None:
    assert parse_input(SmokeInput, {}) == SmokeInput()
    assert parse_input(SmokeInput, {"team": "research", "timeout_s": 5, "hold_s": 1.5}) == SmokeInput(
        team="research", timeout_s=5.0, hold_s=1.5
    )


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"team": 3}, "input.team"),
        ({"timeout_s": "10"}, "input.timeout_s"),
        ({"timeout_s": True}, "input.timeout_s"),
        ({"colour": "red"}, "input.colour"),
    ],
)
def test_bad_input_names_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        parse_input(SmokeInput, data)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SmokeInput(team=""), "input.team"),
        (SmokeInput(timeout_s=0), "input.timeout_s"),
        (SmokeInput(timeout_s=7200), "input.timeout_s"),
        (SmokeInput(hold_s=-1), "input.hold_s"),
    ],
)
def test_smoke_input_limits(params: SmokeInput, field: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        validate_smoke(params)
    assert caught.value.field == field


# --- job events -----------------------------------------------------------------------------------


class RecordingSignaller:
    """The :class:`WorkflowSignaller` seam, recording what would be signalled."""

    def __init__(self, *, fail: bool = False, running: bool = True) -> None:
        self.sent: list[tuple[str, JobEvent]] = []
        self._fail = fail
        self._running = running

        self.checkpoints: list[tuple[str, CheckpointInfo]] = []

    async def job_event(self, workflow_id: str, event: JobEvent) -> bool:
        if self._fail:
            raise RuntimeError("temporal unavailable")
        self.sent.append((workflow_id, event))
        return self._running

    async def checkpoint(self, workflow_id: str, checkpoint: CheckpointInfo) -> bool:
        self.checkpoints.append((workflow_id, checkpoint))
        return self._running


def _record(
    state: int, *, workflow_id: str = "smoke-1", event_id: str = "ev-1", offset: int = 0
) -> ConsumerRecord:  # type: ignore[type-arg]
    event = events_pb2.JobStateChanged(job_id="job-1", team="smoke", state=state)  # type: ignore[arg-type]
    event.meta.event_id = event_id
    event.meta.producer = "scheduler"
    if workflow_id:
        event.labels["workflow_id"] = workflow_id
    value = event.SerializeToString()
    headers = eventkeys.headers_for(event, topic=TOPIC)
    return ConsumerRecord(TOPIC, 0, offset, 0, 0, b"job-1", value, None, 5, len(value), headers)


def _consumer(db: Database, signaller: RecordingSignaller) -> EventConsumer:
    # Constructing the consumer connects nothing; handle() is the per-record path run() takes.
    return EventConsumer(
        db,
        bootstrap="unused:9",
        group_id="orchestrator",
        topics=[TOPIC],
        handler=JobEventHandler(signaller).handle,
        verifier=eventkeys.verifier(),
        max_attempts=1,
    )


async def _rows(db: Database) -> list[tuple[str, str, str, str]]:
    async with db.session() as session:
        rows = (await session.scalars(sa.select(JobEventRow).order_by(JobEventRow.received_at))).all()
    return [(r.event_id, r.job_id, r.workflow_id, r.state) for r in rows]


async def test_event_of_a_workflow_job_is_recorded_and_signalled_once(db: Database) -> None:
    signaller = RecordingSignaller()
    consumer = _consumer(db, signaller)

    assert await consumer.handle(_record(common_pb2.JOB_STATE_PENDING)) is True
    assert await consumer.handle(_record(common_pb2.JOB_STATE_PENDING, offset=1)) is False  # redelivered

    assert signaller.sent == [("smoke-1", JobEvent(job_id="job-1", state="PENDING", event_id="ev-1"))]
    assert await _rows(db) == [("ev-1", "job-1", "smoke-1", "PENDING")]


async def test_event_without_workflow_label_is_not_routed(db: Database) -> None:
    signaller = RecordingSignaller()
    assert await _consumer(db, signaller).handle(_record(common_pb2.JOB_STATE_RUNNING, workflow_id=""))
    assert signaller.sent == [] and await _rows(db) == []


async def test_event_for_a_closed_workflow_is_recorded_and_consumed(db: Database) -> None:
    signaller = RecordingSignaller(running=False)
    assert await _consumer(db, signaller).handle(_record(common_pb2.JOB_STATE_CANCELLED))
    assert await _rows(db) == [("ev-1", "job-1", "smoke-1", "CANCELLED")]


async def test_failed_signal_records_nothing_so_the_event_can_be_replayed(db: Database) -> None:
    assert (
        await _consumer(db, RecordingSignaller(fail=True)).handle(_record(common_pb2.JOB_STATE_PENDING))
        is False
    )
    assert await _rows(db) == []
    async with db.session() as session:
        assert await session.get(ProcessedEvent, ("orchestrator", "ev-1")) is None


class RecordingStarter:
    """The :class:`WorkflowStarter` seam (the OrchestratorService), recording what it would start."""

    def __init__(self) -> None:
        self.started: list[tuple[str, dict[str, object], str]] = []

    async def start_workflow(
        self, workflow_type: str, data: dict[str, object], workflow_id: str = ""
    ) -> tuple[str, str]:
        self.started.append((workflow_type, dict(data), workflow_id))
        return workflow_id, "run"


async def _checkpoint_of_a_job(
    db: Database, labels: dict[str, str]
) -> tuple[RecordingSignaller, RecordingStarter]:
    """A workflow's job with ``labels`` runs, then publishes a checkpoint; both routed as consumed."""
    signaller, starter = RecordingSignaller(), RecordingStarter()
    job = events_pb2.JobStateChanged(job_id="job-7", team="rlhf", state=common_pb2.JOB_STATE_RUNNING)
    job.meta.event_id = "ev-run"
    job.labels.update({"workflow_id": "rlhf-1-r1-dpo", **labels})
    checkpoint = events_pb2.CheckpointPublished(job_id="job-7", run_id="job-7", step=10, uri="/runs/job-7/hf")
    checkpoint.meta.event_id = "ev-ckpt"
    handler = CheckpointHandler(starter, suite="tinyshakespeare_ppl", limit=5, signaller=signaller)
    async with db.session() as session:
        await JobEventHandler(signaller).handle(job, session)
    async with db.session() as session:
        await handler.handle(checkpoint, session)
    return signaller, starter


async def test_checkpoints_of_rlhf_jobs_reach_their_workflow_but_start_no_eval(db: Database) -> None:
    """The RLHF loop's training jobs carry ``auto_eval=false``: their workflow gets the checkpoint,
    and no second eval-and-promote starts (the loop hands the DPO checkpoint over itself)."""
    signaller, starter = await _checkpoint_of_a_job(db, {AUTO_EVAL_LABEL: "false"})
    [(owner, info)] = signaller.checkpoints
    assert owner == "rlhf-1-r1-dpo" and info.uri == "/runs/job-7/hf" and info.step == 10
    assert starter.started == []


async def test_checkpoints_of_other_workflow_jobs_are_evaluated(db: Database) -> None:
    signaller, starter = await _checkpoint_of_a_job(db, {"recipe": "smoke"})
    assert [owner for owner, _ in signaller.checkpoints] == ["rlhf-1-r1-dpo"]
    [(kind, data, workflow_id)] = starter.started
    assert (kind, workflow_id, data["uri"]) == ("eval_and_promote", "eval-job-7-step-10", "/runs/job-7/hf")


async def test_typed_routing_hints_route_without_labels(db: Database) -> None:
    """A job submitted with typed routing (``JobRouting``) and no routing labels reaches its
    workflow and, with ``skip_auto_eval``, starts no eval."""
    signaller, starter = RecordingSignaller(), RecordingStarter()
    job = events_pb2.JobStateChanged(job_id="job-8", team="rlhf", state=common_pb2.JOB_STATE_RUNNING)
    job.meta.event_id = "ev-typed"
    job.routing.workflow_id = "rlhf-2-r1-dpo"
    job.routing.skip_auto_eval = True
    checkpoint = events_pb2.CheckpointPublished(job_id="job-8", run_id="job-8", step=3, uri="/runs/job-8/hf")
    checkpoint.meta.event_id = "ev-ckpt-8"
    handler = CheckpointHandler(starter, suite="tinyshakespeare_ppl", limit=5, signaller=signaller)
    async with db.session() as session:
        await JobEventHandler(signaller).handle(job, session)
    async with db.session() as session:
        await handler.handle(checkpoint, session)
    assert [owner for owner, _ in signaller.checkpoints] == ["rlhf-2-r1-dpo"]
    assert starter.started == []


def test_the_rlhf_loop_labels_its_training_jobs_and_only_the_rlhf_worker_runs_it() -> None:
    from forge_orchestrator.rlhf.workflow import RlhfInput, RlhfWorkflow

    train = RlhfWorkflow()._train(RlhfInput(policy_uri="/p", work_uri="/w"), "dpo-r1", "dpo_hh", [])
    assert train.labels == {AUTO_EVAL_LABEL: "false"}
    assert KINDS["rlhf"].queue("forge-orchestrator") == "forge-orchestrator-rlhf"
    assert KINDS["training"].queue("forge-orchestrator") == "forge-orchestrator"
    assert RlhfWorkflow not in WORKFLOWS


@pytest.mark.parametrize(
    ("labels", "field"),
    [({"workflow_id": "x"}, "input.labels.workflow_id"), ({"": "x"}, "input.labels.")],
)
def test_training_labels_may_not_replace_the_routing_labels(labels: dict[str, str], field: str) -> None:
    from forge_orchestrator.training.service import validate_train

    with pytest.raises(errors.ValidationError) as caught:
        validate_train(TrainInput(team="t", recipe="smoke", labels=labels))
    assert caught.value.field == field


async def test_a_kind_whose_worker_is_disabled_is_refused_with_the_reason() -> None:
    kinds = {k: v for k, v in KINDS.items() if k != "rlhf"}
    service = OrchestratorService(None, "q", kinds=kinds)  # type: ignore[arg-type]  # refused before any call
    with pytest.raises(errors.ValidationError, match="its worker is disabled here") as caught:
        await service.start_workflow("rlhf", {"policy_uri": "/p", "work_uri": "/w"})
    assert caught.value.field == "workflow_type"


# --- translation ----------------------------------------------------------------------------------


def test_completed_view_becomes_a_response_with_result() -> None:
    started = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    view = WorkflowView(
        workflow_id="smoke-1",
        run_id="run-1",
        workflow_type="smoke",
        status=WorkflowExecutionStatus.COMPLETED,
        result={"job_id": "job-1", "states_seen": ["PENDING", "CANCELLED"], "elapsed_s": 0.5},
        started_at=started,
        closed_at=started + dt.timedelta(seconds=1),
    )
    reply = view_to_proto(view)
    assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED
    assert list(reply.result["states_seen"]) == ["PENDING", "CANCELLED"]
    assert reply.started_at.ToDatetime(dt.UTC) == started and not reply.HasField("progress")


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (WorkflowExecutionStatus.RUNNING, orchestrator_pb2.WORKFLOW_STATUS_RUNNING),
        (WorkflowExecutionStatus.FAILED, orchestrator_pb2.WORKFLOW_STATUS_FAILED),
        (WorkflowExecutionStatus.CANCELED, orchestrator_pb2.WORKFLOW_STATUS_CANCELLED),
        (WorkflowExecutionStatus.TERMINATED, orchestrator_pb2.WORKFLOW_STATUS_TERMINATED),
        (WorkflowExecutionStatus.TIMED_OUT, orchestrator_pb2.WORKFLOW_STATUS_TIMED_OUT),
        (WorkflowExecutionStatus.CONTINUED_AS_NEW, orchestrator_pb2.WORKFLOW_STATUS_CONTINUED_AS_NEW),
    ],
)
def test_every_temporal_status_maps(status: WorkflowExecutionStatus, expected: int) -> None:
    assert view_to_proto(WorkflowView("w", "r", "smoke", status)).status == expected


def test_failure_message_names_the_failed_activity_and_cause() -> None:
    cause = ApplicationError(
        "SubmitJob: INVALID_ARGUMENT: spec.team: must not be empty", type="INVALID_ARGUMENT"
    )
    error = ActivityError(
        "Activity task failed",
        scheduled_event_id=5,
        started_event_id=6,
        identity="w",
        activity_type="submit_job",
        activity_id="2",
        retry_state=RetryState.NON_RETRYABLE_FAILURE,
    )
    error.__cause__ = cause
    assert (
        failure_message(error)
        == "activity submit_job failed: SubmitJob: INVALID_ARGUMENT: spec.team: must not be empty"
    )


# --- CLI token --------------------------------------------------------------------------------------


def test_token_from_flag_then_token_file_and_no_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FORGE_ROOT", raising=False)
    nested = tmp_path / "services" / "x"
    nested.mkdir(parents=True)
    with pytest.raises(typer.BadParameter, match="no token for orchestrator"):
        resolve_token("", start=nested)
    (tmp_path / "var" / "secrets").mkdir(parents=True)
    (tmp_path / "var" / "secrets" / "tokens.json").write_text(json.dumps({"orchestrator": "from-file"}))
    assert resolve_token("", start=nested) == "from-file"
    assert resolve_token("explicit", start=nested) == "explicit"
