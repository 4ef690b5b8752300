"""The tracking consumer outwaits an MLflow server that is away for longer than MLflow's client
retries: the events published meanwhile are neither dead-lettered nor dropped, and land once the
server is back (real MLflow server, real broker, real scheduler, the kit's consumer)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from forge.events.v1 import events_pb2
from mlflow.exceptions import MlflowException, RestException

from forge_kit.backoff import RetryPolicy
from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.events import (
    TOPICS,
    DeadLetter,
    KafkaPublisher,
    ProcessedEvent,
    ensure_topics,
    new_meta,
)
from forge_kit.testing import MlflowServer, ServiceProcess, TansuBroker, eventkeys
from forge_orchestrator.activities import SchedulerActivities, SubmitJobInput
from forge_orchestrator.tracking.consumer import RunRecorder, SchedulerJobs
from forge_orchestrator.tracking.tracker import RunFilter, Tracker, unreachable

TEAM = "tracking-outage"


def metrics_event(job_id: str, step: int, loss: float) -> events_pb2.TrainingMetrics:
    event = events_pb2.TrainingMetrics(
        job_id=job_id, run_id=f"run-{job_id}", step=step, values={"loss": loss}
    )
    event.meta.CopyFrom(new_meta("trainer_agent"))
    return event


def test_unreachable_tells_a_server_away_from_a_refused_request() -> None:
    away = MlflowException("API request to http://127.0.0.1:1/api/2.0/x failed with exception Max retries")
    assert unreachable(away)
    assert unreachable(MlflowException("API request to endpoint /x failed with error code 503 != 200"))
    assert unreachable(RuntimeError("wrapped")) is False
    assert unreachable(ConnectionRefusedError())
    refused = RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"})
    assert not unreachable(refused)
    assert not unreachable(MlflowException("API request to endpoint /x failed with error code 404 != 200"))
    assert unreachable(RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "busy"}))


async def _dead_letters(db: Database, group: str) -> list[str]:
    async with db.session() as session:
        rows = await session.scalars(sa.select(DeadLetter.error).where(DeadLetter.consumer_group == group))
        return list(rows.all())


async def _processed(db: Database, group: str, ids: list[str]) -> set[str]:
    async with db.session() as session:
        rows = await session.scalars(
            sa.select(ProcessedEvent.event_id).where(
                ProcessedEvent.consumer_group == group, ProcessedEvent.event_id.in_(ids)
            )
        )
        return set(rows.all())


@pytest.mark.asyncio
@pytest.mark.integration
async def test_metrics_sent_while_mlflow_is_down_past_its_client_retries_are_not_lost(
    db: Database,
    kafka_broker: TansuBroker,
    scheduler: ServiceProcess,
    scheduler_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MLflow's client gives up at once: every failed call reaches the consumer's own handling.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    await ensure_topics(kafka_broker.bootstrap)
    mlflow = MlflowServer(tmp_path / "mlflow", log_path=str(tmp_path / "mlflow.log")).start()
    tracker = Tracker(mlflow.url)
    jobs = SchedulerJobs(scheduler.grpc_target, scheduler_token)
    recorder = RunRecorder(tracker, jobs, retry=RetryPolicy(base_s=0.2, cap_s=1.0))
    group = f"tracking-outage-{uuid.uuid4().hex[:8]}"
    consumer = EventConsumer(
        db,
        bootstrap=kafka_broker.bootstrap,
        group_id=group,
        topics=[
            TOPICS[m.DESCRIPTOR.full_name] for m in (events_pb2.JobStateChanged, events_pb2.TrainingMetrics)
        ],
        handler=recorder.handle,
        verifier=eventkeys.verifier(),
        max_attempts=2,
        session_timeout_ms=6_000,
    )
    await consumer.start()
    task = asyncio.create_task(consumer.run())
    activities = SchedulerActivities(scheduler.grpc_target, scheduler_token)
    publisher = KafkaPublisher(kafka_broker.bootstrap, signer=eventkeys.signer("trainer_agent"))
    try:
        await activities.ensure_team(TEAM)
        job_id = await activities.submit_job(
            SubmitJobInput(
                name="tiny-pretrain",
                team=TEAM,
                command=[sys.executable, "-m", "forge_training.run", "--recipe", "smoke"],
                request_id=uuid.uuid4().hex,
                labels={"recipe": "smoke"},
                kind="training",
                gpu_count=1,
                gpu_type="SIM",
            )
        )
        deadline = time.monotonic() + 60
        while not (found := await asyncio.to_thread(tracker.find_runs, RunFilter(job_id=job_id))):
            assert time.monotonic() < deadline, "the job's run was never made"
            await asyncio.sleep(0.5)
        run_id = found[0].run_id
        mlflow.stop()
        sent = []
        for step, loss in ((10, 3.1), (20, 2.9)):
            event = metrics_event(job_id, step, loss)
            await publisher.publish(event, key=job_id)
            sent.append(str(event.meta.event_id))
        # Far past what the client and the consumer's own attempts would try.
        await asyncio.sleep(8)
        assert await _dead_letters(db, group) == []
        assert await _processed(db, group, sent) == set()
        mlflow.start()
        deadline = time.monotonic() + 120
        while await _processed(db, group, sent) != set(sent):
            assert time.monotonic() < deadline, "the metrics sent while MLflow was down never landed"
            await asyncio.sleep(0.5)
        assert await asyncio.to_thread(tracker.metric_history, run_id, "loss") == [(10, 3.1), (20, 2.9)]
        assert await _dead_letters(db, group) == []
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await consumer.stop()
        await publisher.close()
        await activities.close()
        await jobs.close()
        mlflow.stop()
