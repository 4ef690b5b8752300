"""The tracking consumer against a real MLflow server, the real broker and the real scheduler.

A training job is submitted to the scheduler (which publishes its ``JobStateChanged``); the test
then publishes what the trainer agent and the eval service would (``TrainingMetrics``,
``CheckpointPublished`` with its manifest in the object store, ``EvalCompleted``) and the job's
terminal state, and reads the run back through MLflow's client: tags, params, metrics per step,
eval results, the checkpoint and loss-curve artifacts, and the sweep parent. Replays add nothing;
a metric for a job the scheduler does not know is dropped, one signed by a service that does not
own the topic is rejected by the kit's consumer; a late metric lands on the closed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.events import TOPICS, KafkaPublisher, ProcessedEvent, ensure_topics, new_meta
from forge_kit.objectstore import ObjectStore
from forge_kit.testing import (
    MlflowServer,
    ServiceProcess,
    TansuBroker,
    TemporalDevServer,
    base_env,
    eventkeys,
)
from forge_orchestrator.activities import SchedulerActivities, SubmitJobInput
from forge_orchestrator.tracking.consumer import RunRecorder, SchedulerJobs
from forge_orchestrator.tracking.tracker import PARENT_TAG, RunFilter, Tracker

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]

TEAM = "tracking-team"
EVENT_TYPES = (
    events_pb2.JobStateChanged,
    events_pb2.TrainingMetrics,
    events_pb2.CheckpointPublished,
    events_pb2.EvalCompleted,
)


@dataclass
class Rig:
    tracker: Tracker
    publishers: dict[str, KafkaPublisher]
    """One per producer, each signing with that producer's test key."""
    objects: ObjectStore
    group: str
    db: Database
    submit: Callable[[dict[str, str], list[str]], Awaitable[str]]

    async def processed(self, event_ids: list[str], timeout_s: float = 60.0) -> None:
        """Wait until the consumer group recorded every one of ``event_ids``."""
        deadline = time.monotonic() + timeout_s
        while True:
            async with self.db.session() as session:
                seen = set(
                    (
                        await session.scalars(
                            sa.select(ProcessedEvent.event_id).where(
                                ProcessedEvent.consumer_group == self.group,
                                ProcessedEvent.event_id.in_(event_ids),
                            )
                        )
                    ).all()
                )
            if seen == set(event_ids):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"events not consumed within {timeout_s}s: {sorted(set(event_ids) - seen)}")
            await asyncio.sleep(0.3)

    async def publish(self, message: events_pb2.TrainingMetrics | object, producer: str, key: str) -> str:
        """Publish ``message`` as ``producer`` would (signed with its key); returns its event id."""
        await self.publishers[producer].publish(message, key=key)  # type: ignore[arg-type]
        return str(message.meta.event_id)  # type: ignore[attr-defined]


@pytest.fixture
async def rig(
    db: Database,
    kafka_broker: TansuBroker,
    scheduler: ServiceProcess,
    scheduler_token: str,
    mlflow_server: MlflowServer,
    tmp_path: Path,
) -> AsyncIterator[Rig]:
    await ensure_topics(kafka_broker.bootstrap)
    tracker = Tracker(mlflow_server.url)
    objects = ObjectStore(str(tmp_path / "objects"))
    jobs = SchedulerJobs(scheduler.grpc_target, scheduler_token)
    recorder = RunRecorder(tracker, jobs, objects=objects, code_version="0123abc")
    group = f"tracking-test-{uuid.uuid4().hex[:8]}"
    consumer = EventConsumer(
        db,
        bootstrap=kafka_broker.bootstrap,
        group_id=group,
        topics=[TOPICS[m.DESCRIPTOR.full_name] for m in EVENT_TYPES],
        handler=recorder.handle,
        verifier=eventkeys.verifier(),
        session_timeout_ms=6_000,
    )
    await consumer.start()
    task = asyncio.create_task(consumer.run())
    activities = SchedulerActivities(scheduler.grpc_target, scheduler_token)
    await activities.ensure_team(TEAM)

    async def submit(labels: dict[str, str], overrides: list[str]) -> str:
        command = [sys.executable, "-m", "forge_training.run", "--recipe", labels["recipe"]]
        command += [arg for pair in overrides for arg in ("--set", pair)]
        return await activities.submit_job(
            SubmitJobInput(
                name="tiny-pretrain",
                team=TEAM,
                command=command,
                request_id=uuid.uuid4().hex,
                labels=labels,
                kind="training",
                gpu_count=1,
                gpu_type="SIM",
            )
        )

    publishers = {
        p: KafkaPublisher(kafka_broker.bootstrap, signer=eventkeys.signer(p))
        for p in ("scheduler", "trainer_agent", "eval")
    }
    yield Rig(tracker, publishers, objects, group, db, submit)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await consumer.stop()
    for publisher in publishers.values():
        await publisher.close()
    await activities.close()
    await jobs.close()


async def wait_for_run(tracker: Tracker, job_id: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await asyncio.to_thread(tracker.find_runs, RunFilter(job_id=job_id))
        if found and "overrides" in found[0].params:  # made, and its params logged
            return found[0].run_id
        if time.monotonic() > deadline:
            pytest.fail(f"no MLflow run for job {job_id} within {timeout_s}s")
        await asyncio.sleep(0.5)


def metrics_event(job_id: str, step: int, loss: float) -> events_pb2.TrainingMetrics:
    event = events_pb2.TrainingMetrics(
        job_id=job_id,
        run_id=f"run-{job_id}",
        step=step,
        values={"loss": loss, "lr": 1e-3, "tokens_per_s": 5000.0 + step, "mfu": 0.31},
    )
    event.meta.CopyFrom(new_meta("trainer_agent"))
    return event


async def test_training_run_is_recorded_once_with_params_metrics_eval_and_artifacts(rig: Rig) -> None:
    tracker = rig.tracker
    sweep = uuid.uuid4().hex[:10]
    parent = await asyncio.to_thread(tracker.ensure_sweep_run, sweep, f"sweep-{sweep}", {"space": "lr"})
    labels = {"recipe": "tiny_pretrain", "workflow_id": f"wf-{sweep}", "sweep_id": sweep, "trial": "3"}
    job_id = await rig.submit(labels, ["optim.lr=0.001", "seed=7"])
    # 1. The scheduler's JobStateChanged (PENDING) makes the run, parented to the sweep.
    run_id = await wait_for_run(tracker, job_id)
    run = await asyncio.to_thread(tracker.get_run, run_id)
    assert run.tags["forge.job_id"] == job_id
    assert run.tags["forge.workflow_id"] == f"wf-{sweep}"
    assert run.tags["forge.team"] == TEAM
    assert run.tags["forge.recipe"] == "tiny_pretrain"
    assert (run.tags["forge.sweep_id"], run.tags["forge.trial"]) == (sweep, "3")
    assert run.tags[PARENT_TAG] == parent
    assert run.params["overrides"] == "optim.lr=0.001 seed=7"
    assert run.params["override.optim.lr"] == "0.001"
    assert run.params["code_version"] == "0123abc"

    # 2. What the trainer agent publishes: two steps of metrics and a checkpoint with its manifest.
    first = [metrics_event(job_id, 10, 3.2), metrics_event(job_id, 20, 2.6)]
    ids = [await rig.publish(e, "trainer_agent", job_id) for e in first]
    manifest_key = f"checkpoints/run-{job_id}/step-20/manifest.json"
    meta = {"recipe_hash": "c0ffee12", "data_hash": "da7a5e7", "config": {"seed": 7, "optim": {"lr": 1e-3}}}
    rig.objects.put_bytes(
        manifest_key, json.dumps({"run_id": f"run-{job_id}", "step": 20, "meta": meta}).encode()
    )
    checkpoint = events_pb2.CheckpointPublished(
        job_id=job_id,
        run_id=f"run-{job_id}",
        step=20,
        uri=rig.objects.url(f"checkpoints/run-{job_id}/step-20/hf"),
        manifest_uri=rig.objects.url(manifest_key),
        metrics={"loss": 2.6},
    )
    ids.append(await rig.publish(checkpoint, "trainer_agent", job_id))
    await rig.processed(ids)
    # 3. The eval service's result for that checkpoint (eval-and-promote names the model after the run).
    evaluated = events_pb2.EvalCompleted(
        run_id="eval-1",
        suite="tinyshakespeare_ppl",
        model=common_pb2.ModelRef(name=f"run-{job_id}", version="step-20"),
        metrics={"perplexity": 11.5},
        passed_gate=True,
    )
    finished = events_pb2.JobStateChanged(
        job_id=job_id,
        team=TEAM,
        name="tiny-pretrain",
        previous_state=common_pb2.JOB_STATE_RUNNING,
        state=common_pb2.JOB_STATE_SUCCEEDED,
        labels=labels,
    )
    ids = [
        await rig.publish(evaluated, "eval", "production"),
        await rig.publish(finished, "scheduler", job_id),
    ]
    await rig.processed(ids)

    run = await asyncio.to_thread(tracker.get_run, run_id)
    assert run.status == "FINISHED"
    assert (run.params["config_hash"], run.params["data_hash"], run.params["seed"]) == (
        "c0ffee12",
        "da7a5e7",
        "7",
    )
    assert run.tags["forge.checkpoint_uri"] == checkpoint.uri
    assert await asyncio.to_thread(tracker.metric_history, run_id, "loss") == [(10, 3.2), (20, 2.6)]
    assert await asyncio.to_thread(tracker.metric_history, run_id, "tokens_per_s") == [
        (10, 5010.0),
        (20, 5020.0),
    ]
    assert await asyncio.to_thread(tracker.metric_history, run_id, "mfu") == [(10, 0.31), (20, 0.31)]
    assert await asyncio.to_thread(tracker.metric_history, run_id, "eval/tinyshakespeare_ppl/perplexity") == [
        (20, 11.5)
    ]
    assert await asyncio.to_thread(tracker.list_artifacts, run_id, "checkpoints") == [
        "checkpoints/step-20.json"
    ]
    assert await asyncio.to_thread(tracker.list_artifacts, run_id, "plots") == ["plots/loss_curve.png"]
    assert tracker.run_url(run_id).endswith(f"/runs/{run_id}")

    # 4. Replays: the same events again (same ids) are skipped by the consumer's dedupe; the same
    # step re-sent under a new id (a re-staged line) is stored once by MLflow (same time, value).
    await rig.publish(first[0], "trainer_agent", job_id)
    again = events_pb2.TrainingMetrics()
    again.CopyFrom(first[1])
    again.meta.event_id = str(uuid.uuid4())
    ids = [await rig.publish(again, "trainer_agent", job_id)]
    # 5. A forged metric for a job the scheduler never had: dropped, no run made.
    ids.append(await rig.publish(metrics_event("no-such-job-x", 5, 0.01), "trainer_agent", "no-such-job-x"))
    # 5b. A metric for the real job signed by a service that does not own the topic: the kit's
    # consumer rejects it before the handler (it shares the job's partition with step 30 below).
    forged = metrics_event(job_id, 40, 0.0)
    forged.meta.producer = "eval"
    await rig.publish(forged, "eval", job_id)
    # 6. A late metric after the job finished: recorded on the closed run.
    ids.append(await rig.publish(metrics_event(job_id, 30, 2.4), "trainer_agent", job_id))
    await rig.processed([first[0].meta.event_id, *ids])
    assert await asyncio.to_thread(tracker.metric_history, run_id, "loss") == [
        (10, 3.2),
        (20, 2.6),
        (30, 2.4),
    ]
    assert await asyncio.to_thread(tracker.find_runs, RunFilter(job_id="no-such-job-x")) == []
    assert (await asyncio.to_thread(tracker.get_run, run_id)).status == "FINISHED"
    runs = await asyncio.to_thread(tracker.find_runs, RunFilter(sweep_id=sweep))
    assert {r.run_id for r in runs} == {parent, run_id}  # one run for the job, however often it was seen


async def test_manifest_outside_the_object_store_is_not_read(rig: Rig, tmp_path: Path) -> None:
    job_id = await rig.submit({"recipe": "tiny_pretrain"}, [])
    run_id = await wait_for_run(rig.tracker, job_id)
    outside = tmp_path / "elsewhere" / "manifest.json"
    outside.parent.mkdir()
    outside.write_text(json.dumps({"meta": {"recipe_hash": "stolen", "config": {"seed": 1}}}))
    event = events_pb2.CheckpointPublished(
        job_id=job_id, run_id="r", step=1, uri="file:///x", manifest_uri=str(outside)
    )
    await rig.processed([await rig.publish(event, "trainer_agent", job_id)])
    run = await asyncio.to_thread(rig.tracker.get_run, run_id)
    assert "config_hash" not in run.params and "seed" not in run.params
    assert run.tags["forge.checkpoint_uri"] == "file:///x"


async def test_the_orchestrator_process_tracks_a_job_and_loses_nothing_when_mlflow_restarts(
    kafka_broker: TansuBroker,
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    scheduler_token: str,
    tmp_path: Path,
) -> None:
    """The real orchestrator (``MLFLOW_URI`` set) records a job submitted to the scheduler; a
    metric published while the MLflow server is down arrives once it is back."""
    mlflow = MlflowServer(tmp_path / "mlflow", log_path=str(tmp_path / "mlflow.log")).start()
    suffix = uuid.uuid4().hex[:8]
    env = base_env(
        "orchestrator",
        token="orchestrator-tracking-test",
        data_dir=tmp_path / "orchestrator",
        kafka=kafka_broker.bootstrap,
        temporal_target=temporal_server.target,
        task_queue=f"forge-orchestrator-{suffix}",
        consumer_group=f"orchestrator-{suffix}",
        tracking_consumer_group=f"orchestrator-tracking-{suffix}",
        consumer_session_timeout_ms="3000",
        scheduler_target=scheduler.grpc_target,
        scheduler_token=scheduler_token,
        mlflow_uri=mlflow.url,
        object_store_url=str(tmp_path / "objects"),
    )
    orchestrator = ServiceProcess(
        "forge_orchestrator", env=env, log_path=str(tmp_path / "orchestrator.log")
    ).start()
    activities = SchedulerActivities(scheduler.grpc_target, scheduler_token)
    publisher = KafkaPublisher(kafka_broker.bootstrap, signer=eventkeys.signer("trainer_agent"))
    try:
        await activities.ensure_team(TEAM)
        job_id = await activities.submit_job(
            SubmitJobInput(
                name="tiny-pretrain",
                team=TEAM,
                command=["python", "-m", "forge_training.run", "--recipe", "tiny"],
                request_id=uuid.uuid4().hex,
                labels={"recipe": "tiny", "workflow_id": f"wf-{suffix}"},
                kind="training",
                gpu_count=1,
                gpu_type="SIM",
            )
        )
        tracker = Tracker(mlflow.url)
        run_id = await wait_for_run(tracker, job_id, timeout_s=90)
        run = await asyncio.to_thread(tracker.get_run, run_id)
        assert len(run.params["code_version"]) == 40  # the git commit of this checkout
        mlflow.stop()
        await publisher.publish(metrics_event(job_id, 10, 3.1), key=job_id)
        await asyncio.sleep(3)
        mlflow.start()
        deadline = time.monotonic() + 180
        while not await asyncio.to_thread(tracker.metric_history, run_id, "loss"):
            if time.monotonic() > deadline:
                pytest.fail("the metric published while MLflow was down never arrived")
            await asyncio.sleep(1)
        assert await asyncio.to_thread(tracker.metric_history, run_id, "loss") == [(10, 3.1)]
    finally:
        await publisher.close()
        await activities.close()
        orchestrator.stop()
        mlflow.stop()
