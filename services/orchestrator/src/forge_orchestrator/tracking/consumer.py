"""Training runs into MLflow, from the platform's Kafka events (consumer group ``orchestrator-tracking``).

:class:`RunRecorder` is the handler of a kit :class:`~forge_kit.consumer.EventConsumer`, so each
event is applied once per group (its id is recorded in ``forge_processed_events`` with the
handler's database writes) and inherits whatever verification the kit's consumer does.

- ``JobStateChanged`` of a training job (its labels name a ``recipe``: the training workflow and
  sweep trials set it): the job's MLflow run is made (:meth:`Tracker.ensure_job_run`) with tags
  from the job (:data:`~forge_orchestrator.tracking.tracker.TAG_JOB` …; ``sweep_id``/``trial`` labels
  become the sweep tags and the sweep's parent run its parent) and params (recipe, overrides
  from the job's command, code version). A terminal state closes the run (SUCCEEDED → FINISHED,
  FAILED → FAILED, CANCELLED → KILLED) and logs the loss/LR curve rendered from the run's metrics.
- ``TrainingMetrics``: the step's values as MLflow metrics at that step, timestamped with the
  event's time (tokens/s and MFU come as the values ``tokens_per_s`` and ``mfu``).
- ``CheckpointPublished``: the checkpoint's URI (tag ``forge.checkpoint_uri`` and an artifact
  ``checkpoints/step-<N>.json``) and, from its manifest in the object store, the resolved config
  hash, data hash and seed as params.
- ``EvalCompleted`` of a model named after a tracked run (eval-and-promote names it after the
  training run, version ``step-<N>``): ``eval/<suite>/<metric>`` at step N.

An event of a job the orchestrator has not seen is looked up at the scheduler; a job the
scheduler does not know (a forged or stray event) or that is not a training job is dropped and
counted, never given a run. A late event of a finished job is recorded on its (closed) run.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf.message import Message
from prometheus_client import Counter
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit.backoff import RetryPolicy
from forge_kit.grpckit import LazyChannel
from forge_kit.objectstore import ObjectStore
from forge_orchestrator.activities import state_name
from forge_orchestrator.store import TrackedRunRow
from forge_orchestrator.tracking.tracker import (
    TAG_CHECKPOINT,
    TAG_RECIPE,
    TAG_SWEEP,
    TAG_TEAM,
    TAG_TRIAL,
    TAG_WORKFLOW,
    RunFilter,
    RunStatus,
    Tracker,
    unreachable,
)

log = structlog.get_logger(__name__)

#: Label of a sweep trial's job that resumes an earlier job of the trial
#: (``forge_orchestrator.sweep.model.RESUMES_LABEL``).
RESUMES_LABEL = "resumes_job"

CONSUMER_GROUP = "orchestrator-tracking"
TRACKING_EVENTS = Counter(
    "forge_orchestrator_tracking_events_total",
    "Events the tracking consumer handled, by type and outcome",
    ["event", "outcome"],
)
TERMINAL: dict[str, RunStatus] = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELLED": "KILLED"}
MAX_MANIFEST_BYTES = 4 << 20
LOSS_CURVE = "loss_curve.png"


@dataclass(frozen=True)
class JobInfo:
    """What the tracking consumer needs of a scheduler job."""

    job_id: str
    team: str
    name: str
    labels: dict[str, str]
    command: list[str] = field(default_factory=list)
    training: bool = True


class JobDirectory(Protocol):
    async def get_job(self, job_id: str) -> JobInfo | None:
        """The job, or None when the scheduler has no such job."""


class SchedulerJobs:
    """:class:`JobDirectory` over the scheduler's ``GetJob``."""

    TRAINING_KINDS = (
        scheduler_pb2.JOB_KIND_UNSPECIFIED,
        scheduler_pb2.JOB_KIND_TRAINING,
        scheduler_pb2.JOB_KIND_FINE_TUNE,
    )

    def __init__(self, target: str, token: str, *, rpc_timeout_s: float = 10.0) -> None:
        self._timeout = rpc_timeout_s
        self._channel = LazyChannel(target, token)

    async def get_job(self, job_id: str) -> JobInfo | None:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel.get())
        try:
            reply = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                return None
            raise
        spec = reply.job.spec
        return JobInfo(
            job_id=reply.job.id,
            team=spec.team,
            name=spec.name,
            labels=dict(spec.labels),
            command=list(spec.command),
            training=spec.kind in self.TRAINING_KINDS,
        )

    async def close(self) -> None:
        await self._channel.close()


def overrides_of(command: Sequence[str]) -> list[str]:
    """The ``--set key=value`` pairs of a training command, in order."""
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "--set"]


def job_tags(job: JobInfo) -> dict[str, str]:
    """The run's tags from the job: the contract in :mod:`forge_orchestrator.tracking.tracker`."""
    tags = {TAG_TEAM: job.team, TAG_RECIPE: job.labels.get("recipe", "")}
    for label, tag in (("workflow_id", TAG_WORKFLOW), ("sweep_id", TAG_SWEEP), ("trial", TAG_TRIAL)):
        if job.labels.get(label):
            tags[tag] = job.labels[label]
    return {k: v for k, v in tags.items() if v}


def job_params(job: JobInfo, code_version: str) -> dict[str, str]:
    overrides = overrides_of(job.command)
    params = {"recipe": job.labels.get("recipe", ""), "overrides": shlex.join(overrides)}
    for pair in overrides:
        key, sep, value = pair.partition("=")
        if sep:
            params[f"override.{key.strip()}"] = value
    if code_version:
        params["code_version"] = code_version
    return params


def manifest_params(manifest: Mapping[str, object]) -> dict[str, str]:
    """Config hash, data hash and seed from a checkpoint manifest's ``meta``."""
    meta = manifest.get("meta")
    if not isinstance(meta, dict):
        return {}
    params: dict[str, str] = {}
    if meta.get("recipe_hash"):
        params["config_hash"] = str(meta["recipe_hash"])
    if meta.get("data_hash"):
        params["data_hash"] = str(meta["data_hash"])
    config = meta.get("config")
    if isinstance(config, dict) and "seed" in config:
        params["seed"] = str(config["seed"])
    return params


def render_loss_curve(
    series: Mapping[str, Sequence[tuple[int, float]]],
    path: Path,
    title: str,
    lr: Sequence[tuple[int, float]] = (),
) -> bool:
    """A PNG of each loss series (``loss``, ``val_loss``) against the step, and the learning rate
    on a second axis when given; False (and no file) when there is no loss to draw."""
    drawn = {k: v for k, v in series.items() if v}
    if not drawn:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.subplots()
    for name, points in drawn.items():
        axes.plot([s for s, _ in points], [v for _, v in points], label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title[:80])
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if lr:
        rate = axes.twinx()
        (line,) = rate.plot([s for s, _ in lr], [v for _, v in lr], color="grey", linestyle="--", label="lr")
        rate.set_ylabel("learning rate")
        handles, labels = [*handles, line], [*labels, "lr"]
    axes.legend(handles, labels)
    figure.tight_layout()
    figure.savefig(path)
    return True


def _millis(meta: events_pb2.EventMeta) -> int | None:
    millis = meta.occurred_at.ToMilliseconds()
    return millis if millis > 0 else None


class RunRecorder:
    """The tracking consumer's handler (see the module docstring)."""

    def __init__(
        self,
        tracker: Tracker,
        jobs: JobDirectory,
        *,
        objects: ObjectStore | None = None,
        code_version: str = "",
        curves: Sequence[str] = ("loss", "val_loss"),
        patience_s: float = 3600.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._patience_s = patience_s
        self._retry = retry or RetryPolicy(base_s=0.5, cap_s=30.0)
        self._rng = random.Random()
        self._tracker = tracker
        self._jobs = jobs
        self._objects = objects
        self._code_version = code_version
        self._curves = tuple(curves)

    async def handle(self, event: Message, session: AsyncSession) -> None:
        """Apply one event. While the MLflow server is away (:func:`unreachable`: refused, timed
        out, its client's own retries spent) the same event is tried again with capped, jittered
        backoff (:class:`forge_kit.backoff.RetryPolicy`) for up to ``patience_s``: the consumer's
        offset stays where it is and the event is neither dead-lettered nor dropped, so a server
        restart of any length within the patience loses no metric. Any other error is raised at
        once (the consumer's own attempts, then its dead letters)."""
        kind = type(event).__name__
        started = time.monotonic()
        retry = 0
        while True:
            try:
                await self._apply(event, session, kind)
                return
            except Exception as exc:
                waited = time.monotonic() - started
                if not unreachable(exc) or waited >= self._patience_s:
                    raise
                delay = self._retry.delay(retry, self._rng)
                retry += 1
                TRACKING_EVENTS.labels(kind, "mlflow_unavailable").inc()
                log.warning(
                    "tracking.mlflow_unavailable",
                    event_type=kind,
                    retry=retry,
                    waited_s=round(waited, 1),
                    retry_in_s=round(delay, 2),
                    error=repr(exc)[:300],
                )
                await asyncio.sleep(delay)

    async def _apply(self, event: Message, session: AsyncSession, kind: str) -> None:
        if isinstance(event, events_pb2.JobStateChanged):
            outcome = await self._job_state(event, session)
        elif isinstance(event, events_pb2.TrainingMetrics):
            outcome = await self._metrics(event, session)
        elif isinstance(event, events_pb2.CheckpointPublished):
            outcome = await self._checkpoint(event, session)
        elif isinstance(event, events_pb2.EvalCompleted):
            outcome = await self._eval(event, session)
        else:
            outcome = "ignored"
        TRACKING_EVENTS.labels(kind, outcome).inc()

    # --- the run of a job ------------------------------------------------------------------------

    async def _run_of(
        self, session: AsyncSession, job_id: str, hint: events_pb2.JobStateChanged | None = None
    ) -> TrackedRunRow | None:
        """The job's tracked run, made on first sight; None for a job that gets none."""
        if not job_id:
            return None
        row = await session.get(TrackedRunRow, job_id)
        if row is not None:
            return row
        job = await self._jobs.get_job(job_id)
        if job is None and hint is not None:
            job = JobInfo(job_id, hint.team, hint.name, dict(hint.labels))
        if job is None or not job.training or not job.labels.get("recipe"):
            log.info("tracking.job_skipped", job_id=job_id, known=job is not None)
            return None
        parent = await asyncio.to_thread(self._sweep_parent, job.labels.get("sweep_id", ""))
        run_of = await self._resumed_job(job) or job_id
        run_id = await asyncio.to_thread(
            self._tracker.ensure_job_run,
            run_of,
            tags=job_tags(job),
            params=job_params(job, self._code_version),
            parent_run_id=parent or None,
            name=_run_name(job),
        )
        row = TrackedRunRow(job_id=job_id, mlflow_run_id=run_id, training_run_id="", final_state="")
        # Not flushed here: written at the handler's commit, so no database write lock is held
        # while MLflow is called (a server that is restarting can take minutes to answer).
        session.add(row)
        return row

    async def _resumed_job(self, job: JobInfo) -> str:
        """A promoted sweep trial's later job continues the run of the trial's first job (its
        ``resumes_job`` label), when that job is of the same team, sweep and trial; else ``""``."""
        first = job.labels.get(RESUMES_LABEL, "")
        if not first or first == job.job_id or not job.labels.get("sweep_id"):
            return ""
        earlier = await self._jobs.get_job(first)
        same = earlier is not None and earlier.team == job.team
        for key in ("sweep_id", "trial"):
            same = same and earlier is not None and earlier.labels.get(key) == job.labels.get(key)
        if not same:
            log.warning("tracking.resumes_refused", job_id=job.job_id, resumes=first[:64])
            return ""
        return first

    def _sweep_parent(self, sweep_id: str) -> str:
        if not sweep_id:
            return ""
        try:
            found = self._tracker.find_runs(RunFilter(sweep_id=sweep_id, role="sweep"), max_results=1)
        except ValueError:
            return ""
        return found[0].run_id if found else ""

    async def _job_state(self, event: events_pb2.JobStateChanged, session: AsyncSession) -> str:
        known = await session.get(TrackedRunRow, event.job_id)
        if known is None and not event.labels.get("recipe"):
            return "not_training"
        row = known or await self._run_of(session, event.job_id, hint=event)
        if row is None:
            return "dropped"
        state = state_name(event.state)
        status = TERMINAL.get(state)
        if status is None:
            return "applied"
        await asyncio.to_thread(self._finish, row.mlflow_run_id, status, event.job_id)
        row.final_state = state
        return "finished"

    def _finish(self, run_id: str, status: RunStatus, job_id: str) -> None:
        self._tracker.set_terminated(run_id, status)
        series = {name: self._tracker.metric_history(run_id, name) for name in self._curves}
        lr = self._tracker.metric_history(run_id, "lr")
        with tempfile.TemporaryDirectory(prefix="forge-curve-") as tmp:
            path = Path(tmp) / LOSS_CURVE
            if render_loss_curve(series, path, f"job {job_id}", lr):
                self._tracker.log_artifact(run_id, path, "plots")

    # --- per-step data ---------------------------------------------------------------------------

    async def _metrics(self, event: events_pb2.TrainingMetrics, session: AsyncSession) -> str:
        row = await self._run_of(session, event.job_id)
        if row is None:
            log.warning("tracking.metrics_dropped", job_id=event.job_id[:64], step=event.step)
            return "dropped"
        if event.run_id and not row.training_run_id:
            row.training_run_id = event.run_id[:255]
        await asyncio.to_thread(
            self._tracker.log_metrics,
            row.mlflow_run_id,
            int(event.step),
            dict(event.values),
            timestamp_ms=_millis(event.meta),
        )
        return "late" if row.final_state else "applied"

    async def _checkpoint(self, event: events_pb2.CheckpointPublished, session: AsyncSession) -> str:
        row = await self._run_of(session, event.job_id)
        if row is None:
            return "dropped"
        if event.run_id and not row.training_run_id:
            row.training_run_id = event.run_id[:255]
        params = manifest_params(await asyncio.to_thread(self._manifest, event.manifest_uri))
        record = {
            "step": int(event.step),
            "uri": event.uri,
            "manifest_uri": event.manifest_uri,
            "metrics": dict(event.metrics),
        }
        await asyncio.to_thread(self._record_checkpoint, row.mlflow_run_id, record, params)
        return "applied"

    def _record_checkpoint(self, run_id: str, record: dict[str, object], params: dict[str, str]) -> None:
        self._tracker.log_params(run_id, params)
        self._tracker.set_tags(run_id, {TAG_CHECKPOINT: record["uri"]})
        with tempfile.TemporaryDirectory(prefix="forge-ckpt-") as tmp:
            path = Path(tmp) / f"step-{record['step']}.json"
            path.write_text(json.dumps(record, indent=1, sort_keys=True))
            self._tracker.log_artifact(run_id, path, "checkpoints")

    def _manifest(self, uri: str) -> dict[str, object]:
        """The manifest at ``uri`` if it lies inside the platform's object store, else ``{}``."""
        if not uri or self._objects is None:
            return {}
        root = self._objects.root_url.rstrip("/") + "/"
        if not uri.startswith(root):
            log.warning("tracking.manifest_outside_store", uri=uri[:200])
            return {}
        key = uri[len(root) :]
        try:
            self._objects.path(key)  # refuses keys that climb out of the root
            if self._objects.fs.size(self._objects.path(key)) > MAX_MANIFEST_BYTES:
                raise ValueError("manifest too large")
            body = json.loads(self._objects.get_bytes(key))
        except (OSError, ValueError) as exc:
            log.warning("tracking.manifest_unreadable", uri=uri[:200], error=repr(exc))
            return {}
        return body if isinstance(body, dict) else {}

    async def _eval(self, event: events_pb2.EvalCompleted, session: AsyncSession) -> str:
        name = event.model.name
        if not name:
            return "ignored"
        row = (
            await session.scalars(
                sa.select(TrackedRunRow)
                .where(sa.or_(TrackedRunRow.training_run_id == name, TrackedRunRow.job_id == name))
                .limit(1)
            )
        ).first()
        if row is None:
            return "untracked_model"
        version = event.model.version
        step = int(version.removeprefix("step-")) if version.removeprefix("step-").isdigit() else 0
        suite = event.suite or "suite"
        values = {f"eval/{suite}/{k}": v for k, v in event.metrics.items()}
        values[f"eval/{suite}/passed_gate"] = 1.0 if event.passed_gate else 0.0
        await asyncio.to_thread(
            self._tracker.log_metrics, row.mlflow_run_id, step, values, timestamp_ms=_millis(event.meta)
        )
        return "applied"


def git_commit(start: Path | None = None) -> str:
    """The commit checked out where this package lives (``git rev-parse HEAD``), or ``""``."""
    where = start or Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and len(sha) == 40 else ""


def _run_name(job: JobInfo) -> str:
    trial = job.labels.get("trial", "")
    if job.labels.get("sweep_id") and trial:
        return f"{job.labels['sweep_id']}-trial-{trial}"
    return f"{job.name or 'train'}-{job.job_id}"
