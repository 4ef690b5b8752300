"""Activities of the sweep workflow: the Optuna study and experiment tracking.

The study lives in the orchestrator's database through Optuna's ``RDBStorage``, one study per
sweep named after the sweep's workflow id. Optuna migrates its tables with its own Alembic
version table, which would collide with the orchestrator's, so it gets a place of its own
(:func:`study_storage_url`): the schema ``optuna`` of the same PostgreSQL database, or
``optuna.db`` beside the orchestrator's SQLite file. Suggestions survive a restart of the
orchestrator and TPE sees every finished trial. Every call is idempotent: a trial is found again by its
``forge_index`` user attribute, a finished trial is not told twice.

Tracking goes through a :class:`Tracker` (MLflow, when a tracking URI is configured); without
one the tracking activities do nothing and return empty run ids.
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from temporalio import activity
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

from forge_experiments import sweepspace

INDEX_ATTR = "forge_index"


class Tracker(Protocol):
    """What the sweep needs of experiment tracking (``forge_orchestrator.tracking.tracker.Tracker``)."""

    def ensure_sweep_run(self, sweep_id: str, name: str, params: dict[str, Any]) -> str: ...

    def ensure_job_run(
        self, job_id: str, *, tags: dict[str, str], params: dict[str, Any], parent_run_id: str | None = None
    ) -> str: ...

    def set_terminated(self, run_id: str, status: str) -> None: ...

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> int: ...


#: The tracking activities (``sweep_track_*``) outwait an MLflow server that is away: tried again
#: without limit (every 30 s at most), each try long enough for the MLflow client's own retries.
#: The sweep waits on them rather than failing, and its trials keep running meanwhile.
TRACK_TIMEOUT = timedelta(minutes=3)
TRACK_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=0,
)


@dataclass
class StudyInput:
    sweep_id: str
    space: str
    """The space file's text (validated again here: the activity trusts nothing)."""


@dataclass
class SuggestInput:
    sweep_id: str
    space: str
    index: int
    """Configuration index in the sweep (not the Optuna trial number)."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """A grid configuration to record as this trial; empty: ask the sampler."""


@dataclass
class TellInput:
    sweep_id: str
    index: int
    value: float | None = None
    """The configuration's final metric (mean over its seeds); None: it failed or was stopped."""
    pruned: bool = False


@dataclass
class TrackSweepInput:
    sweep_id: str
    name: str
    params: dict[str, str] = field(default_factory=dict)


@dataclass
class TrackTrialInput:
    job_id: str
    sweep_id: str
    trial: int
    parent_run_id: str
    params: dict[str, str] = field(default_factory=dict)


@dataclass
class TrackEndInput:
    run_id: str
    status: str
    """``FINISHED``, ``KILLED`` (stopped early, cancelled) or ``FAILED``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Logged (at step 0) before the run is closed: the sweep's summary on its parent run."""


def sync_url(url: str) -> str:
    """The orchestrator's async SQLAlchemy URL as the synchronous one Optuna uses."""
    for async_driver, sync_driver in (
        ("sqlite+aiosqlite", "sqlite"),
        ("postgresql+asyncpg", "postgresql+psycopg2"),
    ):
        if url.startswith(async_driver + "://"):
            return sync_driver + url[len(async_driver) :]
    return url


#: PostgreSQL schema of the Optuna tables.
SCHEMA = "optuna"


def study_storage_url(database_url: str) -> str:
    """Where sweeps' studies live, given the orchestrator's database URL (see the module)."""
    url = sync_url(database_url)
    if url.startswith("sqlite:///"):
        return "sqlite:///" + str(Path(url.removeprefix("sqlite:///")).with_name("optuna.db"))
    if url.startswith("postgresql"):
        return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{SCHEMA}"
    return url


def distributions(space: sweepspace.Space) -> dict[str, Any]:
    import optuna

    out: dict[str, Any] = {}
    for p in space.parameters:
        if p.type == "categorical":
            out[p.key] = optuna.distributions.CategoricalDistribution(list(p.values))
        elif p.type == "int":
            out[p.key] = optuna.distributions.IntDistribution(int(p.low), int(p.high), step=p.step)
        else:
            out[p.key] = optuna.distributions.FloatDistribution(p.low, p.high, log=p.type == "loguniform")
    return out


class SweepActivities:
    """Optuna study and tracking calls of sweep workflows (one instance per worker)."""

    def __init__(self, database_url: str, tracker: Tracker | None = None) -> None:
        self._url = study_storage_url(database_url)
        self._tracker = tracker
        self._storage: Any = None
        # Sweeps started together (the cpt workflow's, one per replay fraction) would each create
        # the storage and race on Optuna's migration of a fresh database.
        self._storage_lock = threading.Lock()

    def _rdb(self) -> Any:
        import optuna
        import sqlalchemy as sa

        with self._storage_lock:
            if self._storage is None:
                if self._url.startswith("postgresql"):
                    engine = sa.create_engine(self._url)
                    with engine.begin() as connection:
                        connection.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
                    engine.dispose()
                self._storage = optuna.storages.RDBStorage(self._url, engine_kwargs={"pool_pre_ping": True})
            return self._storage

    def _study(self, sweep_id: str, space: sweepspace.Space) -> Any:
        import optuna

        sampler: Any
        if space.sampler == "tpe":
            sampler = optuna.samplers.TPESampler(seed=space.seed)
        else:
            sampler = optuna.samplers.RandomSampler(seed=space.seed)
        return optuna.create_study(
            study_name=sweep_id,
            storage=self._rdb(),
            sampler=sampler,
            direction="minimize" if space.mode == "min" else "maximize",
            load_if_exists=True,
        )

    @staticmethod
    def _space(text: str) -> sweepspace.Space:
        try:
            return sweepspace.parse(text)
        except Exception as exc:
            raise ApplicationError(f"bad space: {exc}", type="BadSpace", non_retryable=True) from exc

    @activity.defn(name="sweep_create_study")
    async def create_study(self, params: StudyInput) -> str:
        """Create the sweep's study (or find it); returns its name."""
        space = self._space(params.space)
        await asyncio.to_thread(self._study, params.sweep_id, space)
        return params.sweep_id

    @activity.defn(name="sweep_suggest")
    async def suggest(self, params: SuggestInput) -> dict[str, Any]:
        """The parameters of configuration ``index``: the trial recorded for it before, else a
        new one (``fixed`` for a grid, else the sampler's)."""
        space = self._space(params.space)
        return await asyncio.to_thread(self._suggest, params, space)

    def _suggest(self, params: SuggestInput, space: sweepspace.Space) -> dict[str, Any]:
        study = self._study(params.sweep_id, space)
        for trial in study.get_trials(deepcopy=False):
            if trial.user_attrs.get(INDEX_ATTR) == params.index:
                return dict(trial.params)
        if params.fixed:
            study.enqueue_trial(params.fixed, skip_if_exists=False)
        trial = study.ask(distributions(space))
        trial.set_user_attr(INDEX_ATTR, params.index)
        return dict(trial.params)

    @activity.defn(name="sweep_tell")
    async def tell(self, params: TellInput) -> bool:
        """Record the configuration's outcome; False when it was recorded already."""
        return await asyncio.to_thread(self._tell, params)

    def _tell(self, params: TellInput) -> bool:
        import optuna

        study = optuna.load_study(study_name=params.sweep_id, storage=self._rdb())
        for trial in study.get_trials(deepcopy=False):
            if trial.user_attrs.get(INDEX_ATTR) != params.index:
                continue
            if trial.state != optuna.trial.TrialState.RUNNING:
                return False
            if params.value is not None and math.isfinite(params.value):
                study.tell(trial.number, params.value)
            elif params.pruned:
                study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            return True
        return False

    @activity.defn(name="sweep_track_sweep")
    async def track_sweep(self, params: TrackSweepInput) -> str:
        """The sweep's parent run (created once); empty without tracking."""
        if self._tracker is None:
            return ""
        tracker = self._tracker
        return await asyncio.to_thread(
            tracker.ensure_sweep_run, params.sweep_id, params.name, dict(params.params)
        )

    @activity.defn(name="sweep_track_trial")
    async def track_trial(self, params: TrackTrialInput) -> str:
        """The trial's run, a child of the sweep's; empty without tracking."""
        if self._tracker is None:
            return ""
        tags = {"forge.sweep_id": params.sweep_id, "forge.trial": str(params.trial)}
        tracker = self._tracker
        return await asyncio.to_thread(
            lambda: tracker.ensure_job_run(
                params.job_id,
                tags=tags,
                params=dict(params.params),
                parent_run_id=params.parent_run_id or None,
            )
        )

    @activity.defn(name="sweep_track_end")
    async def track_end(self, params: TrackEndInput) -> None:
        """Close a trial's run, or the sweep's parent run with its summary metrics."""
        if self._tracker is None or not params.run_id:
            return
        tracker = self._tracker
        if params.metrics:
            await asyncio.to_thread(tracker.log_metrics, params.run_id, 0, dict(params.metrics))
        await asyncio.to_thread(tracker.set_terminated, params.run_id, params.status)

    def methods(self) -> list[Any]:
        return [
            self.create_study,
            self.suggest,
            self.tell,
            self.track_sweep,
            self.track_trial,
            self.track_end,
        ]
