"""Experiment tracking on an MLflow tracking server: one small, typed client for the platform.

Every training job is one MLflow run in the experiment ``forge`` (:data:`EXPERIMENT`), found
again by its tag ``forge.job_id``; a sweep is a parent run (tags ``forge.role=sweep`` and
``forge.sweep_id``) whose trials are children through MLflow's own ``mlflow.parentRunId`` tag.
Tags every run may carry: :data:`TAG_JOB`, :data:`TAG_WORKFLOW`, :data:`TAG_TEAM`,
:data:`TAG_RECIPE`, and for sweep trials :data:`TAG_SWEEP` and :data:`TAG_TRIAL`.

The methods are synchronous (MLflow's client is); async callers run them in a thread. Every
``ensure_*`` call is idempotent: the run is looked up by its tags before one is created, so a
replayed event or a retried activity finds the run it made the first time. Keys and values come
from users (job labels, recipe overrides): keys MLflow would refuse are dropped, values are cut
to MLflow's limits, and filter values are checked before they reach a search string.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import requests
import structlog

if TYPE_CHECKING:
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

log = structlog.get_logger(__name__)

#: MLflow's own tag names (``mlflow.utils.mlflow_tags``), spelled out so that importing this module
#: does not import MLflow (seconds of CPU): MLflow is imported by the first :class:`Tracker`, and
#: an orchestrator with no tracking server never makes one.
MLFLOW_PARENT_RUN_ID = "mlflow.parentRunId"
MLFLOW_RUN_NAME = "mlflow.runName"

EXPERIMENT = "forge"
TAG_JOB = "forge.job_id"
TAG_WORKFLOW = "forge.workflow_id"
TAG_TEAM = "forge.team"
TAG_RECIPE = "forge.recipe"
TAG_SWEEP = "forge.sweep_id"
TAG_TRIAL = "forge.trial"
TAG_ROLE = "forge.role"
TAG_CHECKPOINT = "forge.checkpoint_uri"
PARENT_TAG = MLFLOW_PARENT_RUN_ID
#: How long a caller that found only its own new run waits before looking for a twin once more.
SETTLE_S = 0.5
#: A run younger than this may still be removed as a duplicate by its creator's rivals.
YOUNG_RUN_S = 5.0

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]

#: MLflow's limits (``mlflow.utils.validation``): longer values are refused, so they are cut here.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
#: Metric, param and tag names MLflow accepts (its own rule, minus the path tricks it also refuses).
_KEY = re.compile(r"^[A-Za-z0-9_\-. /:]{1,250}$")
#: Values allowed inside a search filter (quoted in single quotes there; no quote can close it).
_FILTER_VALUE = re.compile(r"^[A-Za-z0-9_\-.:/@+= ]{1,250}$")
_BATCH = 900  # MLflow takes at most 1000 metrics per log_batch call


def valid_key(key: str) -> bool:
    """Whether MLflow accepts ``key`` as a metric, param or tag name."""
    return bool(_KEY.match(key)) and ".." not in key and not key.startswith("/")


def filter_value(value: str, what: str = "value") -> str:
    """``value`` if it can sit inside a quoted MLflow filter; else :class:`ValueError` naming it."""
    if not _FILTER_VALUE.match(value):
        raise ValueError(
            f"{what} {value[:60]!r} is not allowed in a run filter (letters, digits and _-.:/@+= only)"
        )
    return value


@dataclass(frozen=True)
class RunFilter:
    """Which tracked runs :meth:`Tracker.find_runs` returns; every field narrows the search."""

    recipe: str = ""
    sweep_id: str = ""
    job_id: str = ""
    workflow_id: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)
    role: str = ""
    """``sweep`` for sweeps' parent runs; empty: any run."""

    def to_mlflow(self) -> str:
        """The MLflow search string (every value checked by :func:`filter_value`)."""
        wanted = dict(self.tags)
        for tag, value in (
            (TAG_RECIPE, self.recipe),
            (TAG_SWEEP, self.sweep_id),
            (TAG_JOB, self.job_id),
            (TAG_WORKFLOW, self.workflow_id),
            (TAG_ROLE, self.role),
        ):
            if value:
                wanted[tag] = value
        clauses = []
        for key, value in sorted(wanted.items()):
            if not valid_key(key) or "`" in key:
                raise ValueError(f"tag name {key[:60]!r} is not allowed in a run filter")
            clauses.append(f"tags.`{key}` = '{filter_value(value, f'tag {key}')}'")
        return " and ".join(clauses)


@dataclass(frozen=True)
class TrackedRun:
    """One MLflow run as the platform shows it."""

    run_id: str
    name: str
    status: str
    start_time_ms: int
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]
    """Each metric's latest value."""
    url: str

    @property
    def parent_run_id(self) -> str:
        return self.tags.get(PARENT_TAG, "")


def _cut(value: object, limit: int) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clean(items: Mapping[str, object], limit: int, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in items.items():
        if not valid_key(key):
            log.warning("tracking.key_dropped", kind=what, key=key[:80])
            continue
        out[key] = _cut(value, limit)
    return out


class Tracker:
    """The platform's view of one MLflow tracking server.

    ``tracking_uri`` is where this process reaches the server; ``ui_url`` where people do (the
    links :meth:`run_url` builds), the same by default.
    """

    def __init__(self, tracking_uri: str, *, ui_url: str = "", experiment: str = EXPERIMENT) -> None:
        if not tracking_uri.startswith(("http://", "https://")):
            raise ValueError(f"tracking URI must be an http(s) URL of an MLflow server, got {tracking_uri!r}")
        self.tracking_uri = tracking_uri.rstrip("/")
        self.ui_url = (ui_url or tracking_uri).rstrip("/")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._experiment_name = experiment
        self._experiment_id = ""
        self._lock = threading.Lock()

    # --- experiment and lookup -----------------------------------------------------------------

    def experiment_id(self) -> str:
        """The experiment's id, creating the experiment on first use (two creators: one wins)."""
        from mlflow.exceptions import MlflowException

        with self._lock:
            if not self._experiment_id:
                found = self._client.get_experiment_by_name(self._experiment_name)
                if found is None:
                    try:
                        self._experiment_id = self._client.create_experiment(self._experiment_name)
                    except MlflowException:
                        found = self._client.get_experiment_by_name(self._experiment_name)
                        if found is None:
                            raise
                if found is not None:
                    self._experiment_id = str(found.experiment_id)
            return self._experiment_id

    def _oldest(self, run_filter: RunFilter) -> tuple[str, int]:
        """The oldest matching run and its start time (ms): by start time, then run id, so that
        every caller picks the same one even when two were started in the same millisecond."""
        runs = self._client.search_runs(
            [self.experiment_id()],
            filter_string=run_filter.to_mlflow(),
            max_results=50,
            order_by=["attributes.start_time ASC"],
        )
        oldest = min(runs, key=lambda r: (r.info.start_time, r.info.run_id), default=None)
        return (oldest.info.run_id, int(oldest.info.start_time or 0)) if oldest is not None else ("", 0)

    def _one(self, run_filter: RunFilter) -> str:
        return self._oldest(run_filter)[0]

    def _found(self, run_filter: RunFilter) -> str:
        """The run to use when one exists: a run created in the last seconds may still lose to a
        rival created in the same instant (:meth:`_settle`), so a young one is looked up again
        once the creators have settled."""
        run_id, started = self._oldest(run_filter)
        if run_id and time.time() * 1000 - started < YOUNG_RUN_S * 1000:
            time.sleep(2 * SETTLE_S)
            run_id = self._one(run_filter) or run_id
        return run_id

    def find_runs(self, run_filter: RunFilter | None = None, *, max_results: int = 100) -> list[TrackedRun]:
        """Runs matching ``run_filter``, newest first (at most ``max_results``, 1-1000)."""
        if not 1 <= max_results <= 1000:
            raise ValueError(f"max_results must be in 1..1000, got {max_results}")
        runs = self._client.search_runs(
            [self.experiment_id()],
            filter_string=(run_filter or RunFilter()).to_mlflow(),
            max_results=max_results,
            order_by=["attributes.start_time DESC"],
        )
        return [
            TrackedRun(
                run_id=r.info.run_id,
                name=r.info.run_name or "",
                status=r.info.status,
                start_time_ms=int(r.info.start_time or 0),
                tags=dict(r.data.tags),
                params=dict(r.data.params),
                metrics=dict(r.data.metrics),
                url=self.run_url(r.info.run_id),
            )
            for r in runs
        ]

    def get_run(self, run_id: str) -> TrackedRun:
        """One run by id (:class:`mlflow.exceptions.MlflowException` when there is none)."""
        r = self._client.get_run(run_id)
        return TrackedRun(
            run_id=r.info.run_id,
            name=r.info.run_name or "",
            status=r.info.status,
            start_time_ms=int(r.info.start_time or 0),
            tags=dict(r.data.tags),
            params=dict(r.data.params),
            metrics=dict(r.data.metrics),
            url=self.run_url(r.info.run_id),
        )

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every logged value of ``key``, by step."""
        history = self._client.get_metric_history(run_id, key)
        return sorted((int(m.step), float(m.value)) for m in history)

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI."""
        return f"{self.ui_url}/#/experiments/{self.experiment_id()}/runs/{run_id}"

    # --- runs ------------------------------------------------------------------------------------

    def ensure_sweep_run(self, sweep_id: str, name: str, params: Mapping[str, object]) -> str:
        """The sweep's parent run (created on first call); its params are logged once."""
        filter_value(sweep_id, "sweep id")
        found = RunFilter(sweep_id=sweep_id, role="sweep")
        run_id = self._found(found)
        if not run_id:
            tags = {TAG_ROLE: "sweep", TAG_SWEEP: sweep_id}
            run_id = self._settle(found, self._create(name or f"sweep-{sweep_id}", tags))
        self.log_params(run_id, params)
        return run_id

    def ensure_workflow_run(
        self, workflow_id: str, role: str, name: str, params: Mapping[str, object]
    ) -> str:
        """The run of a workflow that is not one job (the ``synthetic`` workflow): tags
        ``forge.workflow_id`` and ``forge.role=<role>``, created on first call; params logged once."""
        filter_value(workflow_id, "workflow id")
        found = RunFilter(workflow_id=workflow_id, role=role)
        run_id = self._found(found)
        if not run_id:
            tags = {TAG_ROLE: role, TAG_WORKFLOW: workflow_id}
            run_id = self._settle(found, self._create(name or f"{role}-{workflow_id}", tags))
        self.log_params(run_id, params)
        return run_id

    def ensure_job_run(
        self,
        job_id: str,
        *,
        tags: Mapping[str, str],
        params: Mapping[str, object],
        parent_run_id: str | None = None,
        name: str = "",
    ) -> str:
        """The run of scheduler job ``job_id`` (created on first call). Later calls add the tags
        and params not yet there (a param already logged keeps its first value) and the parent
        when the run has none."""
        filter_value(job_id, "job id")
        run_id = self._found(RunFilter(job_id=job_id))
        all_tags = {**tags, TAG_JOB: job_id}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        if not run_id:
            run_id = self._settle(RunFilter(job_id=job_id), self._create(name or job_id, all_tags))
        else:
            existing = self._client.get_run(run_id).data.tags
            missing = {k: v for k, v in all_tags.items() if k not in existing}
            if missing:
                self.set_tags(run_id, missing)
        self.log_params(run_id, params)
        return run_id

    def _settle(self, run_filter: RunFilter, created: str) -> str:
        """After creating ``created``: if another caller made a run for the same thing at the same
        time (the sweep's activity and the tracking consumer may), the oldest one is kept and
        ours is deleted, so every caller ends up with the same run."""
        from mlflow.exceptions import MlflowException

        # A run another caller created in the same instant may not be visible yet: decide only
        # once it has had time to appear, so every caller sees the same candidates.
        time.sleep(SETTLE_S)
        oldest = self._one(run_filter)
        if oldest == created:
            # On a loaded server a rival's run can appear later than that, older than ours (its
            # start time is its caller's clock): confirm once more before keeping ours.
            time.sleep(SETTLE_S)
            oldest = self._one(run_filter)
        if oldest and oldest != created:
            with contextlib.suppress(MlflowException):  # a rival may have removed it already
                self._client.delete_run(created)
            log.info("tracking.duplicate_run_removed", kept=oldest, removed=created)
            return oldest
        return created

    def _create(self, name: str, tags: Mapping[str, str]) -> str:
        clean = _clean(tags, MAX_TAG_VALUE, "tag")
        clean[MLFLOW_RUN_NAME] = _cut(name, MAX_KEY)
        run = self._client.create_run(self.experiment_id(), tags=clean, run_name=clean[MLFLOW_RUN_NAME])
        log.info("tracking.run_created", run_id=run.info.run_id, name=name)
        return run.info.run_id

    def set_tags(self, run_id: str, tags: Mapping[str, object]) -> None:
        from mlflow.entities import RunTag

        clean = _clean(tags, MAX_TAG_VALUE, "tag")
        if clean:
            self._client.log_batch(run_id, tags=[RunTag(k, v) for k, v in clean.items()])

    def log_params(self, run_id: str, params: Mapping[str, object]) -> list[str]:
        """Log the params the run does not have yet; returns the keys whose logged value differs
        from the one given (MLflow params never change; the first value stays)."""
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        clean = _clean(params, MAX_PARAM_VALUE, "param")
        if not clean:
            return []
        existing = self._client.get_run(run_id).data.params
        conflicts = [k for k, v in clean.items() if k in existing and existing[k] != v]
        if conflicts:
            log.warning("tracking.param_conflict", run_id=run_id, keys=conflicts)
        new = [Param(k, v) for k, v in clean.items() if k not in existing]
        for start in range(0, len(new), 100):
            try:
                self._client.log_batch(run_id, params=new[start : start + 100])
            except MlflowException as exc:
                if not _param_taken(exc):
                    raise
                # Another caller logged some of them in between: log the rest one by one.
                conflicts += self._log_params_one_by_one(run_id, new[start : start + 100])
        return conflicts

    def _log_params_one_by_one(self, run_id: str, params: Sequence[Param]) -> list[str]:
        from mlflow.exceptions import MlflowException

        conflicts = []
        for param in params:
            try:
                self._client.log_batch(run_id, params=[param])
            except MlflowException as exc:
                if not _param_taken(exc):
                    raise
                conflicts.append(param.key)
        if conflicts:
            log.warning("tracking.param_conflict", run_id=run_id, keys=conflicts)
        return conflicts

    def log_metrics(
        self, run_id: str, step: int, metrics: Mapping[str, float], *, timestamp_ms: int | None = None
    ) -> int:
        """Log ``metrics`` at ``step``; non-finite values and refused names are skipped. Returns
        how many were logged. Give the event's time as ``timestamp_ms``: MLflow then stores a
        repeated (name, step, value, time) once, so a replay adds nothing."""
        from mlflow.entities import Metric

        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        stamp = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        rows = [
            Metric(k, float(v), stamp, int(step))
            for k, v in metrics.items()
            if valid_key(k) and isinstance(v, int | float) and math.isfinite(float(v))
        ]
        for start in range(0, len(rows), _BATCH):
            self._client.log_batch(run_id, metrics=rows[start : start + _BATCH])
        return len(rows)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local file into the run's artifacts (through the server)."""
        self._client.log_artifact(run_id, str(path), artifact_path)

    def list_artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        return [a.path for a in self._client.list_artifacts(run_id, path)]

    def set_terminated(self, run_id: str, status: str) -> None:
        """Close the run as FINISHED, FAILED or KILLED (:data:`RunStatus`; anything else is a
        ValueError; setting it again is harmless)."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status must be FINISHED, FAILED or KILLED, got {status!r}")
        self._client.set_terminated(run_id, status)


def unreachable(exc: BaseException) -> bool:
    """Did a call fail because the server is away (refused connection, timeout, retries spent,
    a 5xx from it or a proxy before it), rather than because it refused the request? Only the
    first is worth waiting out: the same request succeeds once the server is back."""
    from mlflow.exceptions import MlflowException, RestException

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionError | TimeoutError | requests.exceptions.RequestException):
            return True
        if isinstance(current, RestException):
            if current.error_code == "TEMPORARILY_UNAVAILABLE":
                return True
        elif isinstance(current, MlflowException):
            text = str(current.message)
            if text.startswith("API request to") and any(
                mark in text
                for mark in ("failed with exception", "failed with timeout", "failed with error code 5")
            ):
                return True
        current = current.__cause__ or current.__context__
    return False


def differing_params(runs: Sequence[TrackedRun]) -> dict[str, list[str]]:
    """Params whose value is not the same in every run (missing counts as ``""``), by name."""
    keys = sorted({k for r in runs for k in r.params})
    table = {k: [r.params.get(k, "") for r in runs] for k in keys}
    return {k: values for k, values in table.items() if len(set(values)) > 1}


def _param_taken(exc: MlflowException) -> bool:
    """Whether logging a param failed because the run has it already: MLflow's own check, or the
    store's unique key when another caller inserted it in the same instant (SQLite's
    ``UNIQUE constraint failed``, PostgreSQL's ``duplicate key``)."""
    text = str(exc)
    return exc.error_code == "INVALID_PARAMETER_VALUE" or (
        "params" in text and ("UNIQUE constraint failed" in text or "duplicate key" in text)
    )
