"""Eval domain logic: the model registry and release gate, run requests, run execution, comparisons.

Every registry change is written with its ``ModelPromoted`` event, and every finished run with its
``EvalCompleted`` event, in one transaction (the outbox). Runs are executed by a background worker
through a :class:`~forge_eval.runner.SuiteRunner`; RunSuite itself only validates, pins the spec
and queues the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa
import structlog
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2
from forge.events.v1 import events_pb2
from sqlalchemy.ext.asyncio import AsyncSession

from forge_eval import stats
from forge_eval.runner import ExampleResult, RunnerError, SuiteRunner
from forge_eval.scorers import SCORERS
from forge_eval.spec import BenchmarkCatalog, RunSpec, normalize_options
from forge_eval.store import ExampleRow, MetricRow, ModelRow, RunRow, StageEventRow, utcnow
from forge_eval.tasks import load_task, shipped_tasks
from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event

log = structlog.get_logger(__name__)

RunStatus = eval_pb2.RunStatus
PENDING, RUNNING = RunStatus.RUN_STATUS_PENDING, RunStatus.RUN_STATUS_RUNNING
SUCCEEDED, FAILED = RunStatus.RUN_STATUS_SUCCEEDED, RunStatus.RUN_STATUS_FAILED
Verdict = eval_pb2.Verdict
ALPHA = 0.05
GATE_STAGE = "production"

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_STAGE = re.compile(r"^[a-z][a-z0-9-]{0,63}$")


@dataclass(frozen=True)
class ModelView:
    """A registered model with the stage it holds (the most recently assigned, if several)."""

    row: ModelRow
    stage: str
    traffic_percent: int
    eval_run_ids: tuple[str, ...]


@dataclass(frozen=True)
class MetricDelta:
    """candidate − baseline for one metric."""

    name: str
    result: stats.PairedResult


@dataclass(frozen=True)
class Comparison:
    """Paired comparison of two runs and its verdict."""

    deltas: tuple[MetricDelta, ...]
    verdict: int


def validate_model_name(field: str, value: str) -> None:
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    if not _MODEL_NAME.match(value):
        raise errors.ValidationError(
            field, "must be letters, digits, '.', '_' or '-', at most 128 characters"
        )


def validate_version(field: str, value: str) -> None:
    if not _VERSION.match(value):
        raise errors.ValidationError(field, "must be letters, digits, '.', '_' or '-', at most 64 characters")


def validate_stage(field: str, value: str) -> None:
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    if not _STAGE.match(value):
        raise errors.ValidationError(field, "must be lowercase letters, digits and '-', e.g. 'production'")


def verdict_of(deltas: tuple[MetricDelta, ...], tolerance: float = 0.0) -> int:
    """The release-gate rule on intervals already widened for the number of metrics (Bonferroni):
    WORSE when some metric's interval lies entirely below −``tolerance`` in its better direction,
    BETTER when none does and some lies entirely above ``tolerance``, else NO_DIFFERENCE."""
    if not deltas:
        return Verdict.VERDICT_NO_DIFFERENCE
    gains = [
        (d.result.ci_low, d.result.ci_high)
        if _higher_is_better(d.name)
        else (-d.result.ci_high, -d.result.ci_low)
        for d in deltas
    ]
    if any(high < -tolerance for _, high in gains):
        return Verdict.VERDICT_WORSE
    if any(low > tolerance for low, _ in gains):
        return Verdict.VERDICT_BETTER
    return Verdict.VERDICT_NO_DIFFERENCE


def _higher_is_better(metric: str) -> bool:
    for scorer in SCORERS.values():
        if metric in scorer.higher_is_better:
            return scorer.higher_is_better[metric]
    return True


def _tolerance(suite: str) -> float:
    """The suite's gate tolerance from its shipped task file; 0 for suites without one."""
    if suite not in shipped_tasks():
        return 0.0
    return load_task(suite).gate.tolerance


class EvalService:
    """Owns the eval database; every public method is one transaction."""

    def __init__(
        self,
        db: Database,
        catalog: BenchmarkCatalog,
        runner: SuiteRunner,
        *,
        default_endpoint: str = "",
        producer: str = "eval",
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
        run_concurrency: int = 1,
    ) -> None:
        self._db = db
        self._catalog = catalog
        self._runner = runner
        self._default_endpoint = default_endpoint
        self._producer = producer
        self._clock = clock
        self._on_commit = on_commit
        self._run_concurrency = run_concurrency
        self._queued = asyncio.Event()

    # --- registry ----------------------------------------------------------------------------

    async def register_model(self, name: str, version: str, uri: str, labels: Mapping[str, str]) -> ModelView:
        """Add a model version; an empty version takes the next integer of the family."""
        validate_model_name("ref.name", name)
        if version:
            validate_version("ref.version", version)
        if not uri.strip():
            raise errors.ValidationError("uri", "must not be empty")
        if any(not key for key in labels):
            raise errors.ValidationError("labels", "keys must not be empty")
        async with self._db.session() as session:
            if not version:
                existing = (
                    await session.scalars(sa.select(ModelRow.version).where(ModelRow.name == name))
                ).all()
                version = str(max((int(v) for v in existing if v.isdigit()), default=0) + 1)
            elif await _find_model(session, name, version) is not None:
                raise errors.AlreadyExistsError(f"model {name}:{version} is already registered")
            row = ModelRow(name=name, version=version, uri=uri, labels=dict(labels), created_at=self._clock())
            session.add(row)
            await session.flush()
            return await _model_view(session, row)

    async def list_models(
        self, name: str, stage: str, page_size: int, offset: int
    ) -> tuple[list[ModelView], int]:
        query = sa.select(ModelRow)
        if name:
            query = query.where(ModelRow.name == name)
        async with self._db.session() as session:
            if stage:
                holder = (await _holders(session)).get(stage)
                query = query.where(ModelRow.id == (holder.model_id if holder else -1))
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(
                    query.order_by(ModelRow.created_at.desc(), ModelRow.id.desc())
                    .offset(offset)
                    .limit(page_size)
                )
            ).all()
            return [await _model_view(session, r) for r in rows], total

    async def promote_model(
        self, name: str, version: str, stage: str, *, require_gate: bool, traffic_percent: int, reason: str
    ) -> tuple[ModelView, ModelRow | None]:
        """Make ``name:version`` the holder of ``stage``; with ``require_gate`` only if one of its
        finished eval runs passed the release gate."""
        validate_model_name("ref.name", name)
        if not version:
            raise errors.ValidationError("ref.version", "is required to promote")
        validate_version("ref.version", version)
        validate_stage("stage", stage)
        if traffic_percent > 100:
            raise errors.ValidationError("traffic_percent", "must be between 0 and 100")
        traffic = traffic_percent or 100
        async with self._db.session() as session:
            model = await _find_model(session, name, version)
            if model is None:
                raise errors.NotFoundError(f"model {name}:{version} is not registered")
            gate_run_id = ""
            if require_gate:
                gate_run_id = await self._gate_run(session, model)
            holder = (await _holders(session)).get(stage)
            previous = await session.get(ModelRow, holder.model_id) if holder else None
            why = reason or (f"gate passed: eval run {gate_run_id}" if gate_run_id else "promoted")
            session.add(
                StageEventRow(
                    stage=stage,
                    action="promote",
                    model_id=model.id,
                    previous_model_id=previous.id if previous else None,
                    traffic_percent=traffic,
                    reason=why,
                    gate_run_id=gate_run_id,
                    rolled_back=False,
                    created_at=self._clock(),
                )
            )
            await session.flush()
            await self._stage_promotion(session, model, stage, previous, traffic, why, is_rollback=False)
            view = await _model_view(session, model)
        self._on_commit()
        return view, previous

    async def rollback_model(self, stage: str, reason: str) -> tuple[ModelView, ModelRow]:
        """Give ``stage`` back to the model that held it before its current holder."""
        validate_stage("stage", stage)
        async with self._db.session() as session:
            stack = list(
                (
                    await session.scalars(
                        sa.select(StageEventRow)
                        .where(
                            StageEventRow.stage == stage,
                            StageEventRow.action == "promote",
                            StageEventRow.rolled_back.is_(False),
                        )
                        .order_by(StageEventRow.id)
                    )
                ).all()
            )
            if not stack:
                raise errors.ConflictError(f"stage {stage!r} has no model to roll back")
            current_id = stack[-1].model_id
            while stack and stack[-1].model_id == current_id:
                stack.pop().rolled_back = True
            if not stack:
                raise errors.ConflictError(f"stage {stage!r} has no earlier model to roll back to")
            restored = stack[-1]
            model = await session.get(ModelRow, restored.model_id)
            removed = await session.get(ModelRow, current_id)
            assert model is not None and removed is not None
            why = reason or f"rolled back from {removed.name}:{removed.version}"
            session.add(
                StageEventRow(
                    stage=stage,
                    action="rollback",
                    model_id=model.id,
                    previous_model_id=removed.id,
                    traffic_percent=restored.traffic_percent,
                    reason=why,
                    gate_run_id="",
                    rolled_back=False,
                    created_at=self._clock(),
                )
            )
            await session.flush()
            await self._stage_promotion(
                session, model, stage, removed, restored.traffic_percent, why, is_rollback=True
            )
            view = await _model_view(session, model)
        self._on_commit()
        return view, removed

    async def _gate_run(self, session: AsyncSession, model: ModelRow) -> str:
        runs = (
            await session.scalars(
                sa.select(RunRow)
                .where(RunRow.model_name == model.name, RunRow.model_version == model.version)
                .order_by(RunRow.created_at.desc())
            )
        ).all()
        passing = [r for r in runs if r.status == SUCCEEDED and r.passed_gate]
        if passing:
            return passing[0].id
        ref = f"{model.name}:{model.version}"
        if not runs:
            raise errors.ConflictError(f"release gate: model {ref} has no eval runs")
        summary = "; ".join(
            f"{r.id} ({r.suite}) {_status_name(r.status)}"
            + (": failed the gate" if r.status == SUCCEEDED else f": {r.error}" if r.error else "")
            for r in runs[:5]
        )
        raise errors.ConflictError(
            f"release gate: model {ref} has no finished eval run that passed the gate [{summary}]"
        )

    async def _stage_promotion(
        self,
        session: AsyncSession,
        model: ModelRow,
        stage: str,
        previous: ModelRow | None,
        traffic: int,
        reason: str,
        *,
        is_rollback: bool,
    ) -> None:
        event = events_pb2.ModelPromoted(
            model=common_pb2.ModelRef(name=model.name, version=model.version),
            stage=stage,
            traffic_percent=traffic,
            reason=reason,
            is_rollback=is_rollback,
        )
        if previous is not None:
            event.previous.CopyFrom(common_pb2.ModelRef(name=previous.name, version=previous.version))
        await stage_event(session, event, producer=self._producer, key=stage)

    # --- runs --------------------------------------------------------------------------------

    async def run_suite(
        self,
        suite: str,
        name: str,
        version: str,
        *,
        endpoint: str,
        limit: int,
        seed: int,
        options: Mapping[str, str],
    ) -> RunRow:
        """Validate, pin the spec and queue the run (PENDING); the worker executes it."""
        suites = self._catalog.suites()
        if suite not in suites:
            raise errors.ValidationError(
                "suite",
                f"unknown suite {suite!r}; found under {self._catalog.root}: {', '.join(suites) or 'none'}",
            )
        if not self._runner.supports(suite):
            scorable = ", ".join(s for s in suites if self._runner.supports(s))
            raise errors.ValidationError(
                "suite", f"{suite!r} has data but no scorer yet; runnable: {scorable}"
            )
        validate_model_name("model.name", name)
        if version:
            validate_version("model.version", version)
        endpoint = endpoint or self._default_endpoint
        if not endpoint:
            raise errors.ValidationError("endpoint", "is required: no default model endpoint is configured")
        if not re.match(r"^https?://[^\s/]+", endpoint):
            raise errors.ValidationError("endpoint", "must be an http:// or https:// URL")
        sampling = normalize_options(options)
        datasets = await asyncio.to_thread(self._catalog.dataset_hashes, suite)
        async with self._db.session() as session:
            if not version:
                latest = await session.scalar(
                    sa.select(ModelRow)
                    .where(ModelRow.name == name)
                    .order_by(ModelRow.created_at.desc(), ModelRow.id.desc())
                )
                if latest is None:
                    raise errors.ValidationError(
                        "model.version", f"is required: {name!r} has no registered version"
                    )
                version = latest.version
            spec = RunSpec(
                suite=suite,
                datasets=datasets,
                model_name=name,
                model_version=version,
                sampling=sampling,
                seed=seed,
                limit=limit,
                scorer_version=self._runner.scorer_version(suite),
            )
            run = RunRow(
                id=f"run-{uuid.uuid4().hex[:12]}",
                suite=suite,
                model_name=name,
                model_version=version,
                endpoint=endpoint,
                spec=spec.to_dict(),
                spec_hash=spec.spec_hash(),
                status=PENDING,
                error="",
                example_count=0,
                passed_gate=False,
                created_at=self._clock(),
            )
            session.add(run)
        self._queued.set()
        return run

    async def get_run(self, run_id: str) -> tuple[RunRow, list[MetricRow]]:
        async with self._db.session() as session:
            run = await _run(session, run_id)
            metrics = (
                await session.scalars(
                    sa.select(MetricRow).where(MetricRow.run_id == run_id).order_by(MetricRow.name)
                )
            ).all()
            return run, list(metrics)

    async def list_runs(
        self, suite: str, model_name: str, page_size: int, offset: int
    ) -> tuple[list[tuple[RunRow, list[MetricRow]]], int]:
        query = sa.select(RunRow)
        if suite:
            query = query.where(RunRow.suite == suite)
        if model_name:
            query = query.where(RunRow.model_name == model_name)
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            runs = (
                await session.scalars(
                    query.order_by(RunRow.created_at.desc(), RunRow.id).offset(offset).limit(page_size)
                )
            ).all()
            metrics: dict[str, list[MetricRow]] = defaultdict(list)
            if runs:
                for m in (
                    await session.scalars(
                        sa.select(MetricRow).where(MetricRow.run_id.in_([r.id for r in runs]))
                    )
                ).all():
                    metrics[m.run_id].append(m)
        return [(r, sorted(metrics[r.id], key=lambda m: m.name)) for r in runs], total

    async def run_worker(self) -> None:
        """Execute queued runs for the life of the process.

        1. Put runs a previous process left RUNNING back in the queue; 2. claim the oldest PENDING
        run while fewer than ``run_concurrency`` are executing; 3. execute it in a task; 4. when the
        queue is empty, sleep until RunSuite queues one (or a poll interval passes).
        """
        async with self._db.session() as session:
            await session.execute(
                sa.update(RunRow).where(RunRow.status == RUNNING).values(status=PENDING, started_at=None)
            )
        slots = asyncio.Semaphore(self._run_concurrency)
        tasks: set[asyncio.Task[RunRow]] = set()
        try:
            while True:
                await slots.acquire()
                self._queued.clear()
                run_id = await self.claim_next_run()
                if run_id is None:
                    slots.release()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._queued.wait(), timeout=2.0)
                    continue
                task = asyncio.create_task(self.execute_run(run_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: slots.release())
        finally:
            for task in tasks:
                task.cancel()

    async def claim_next_run(self) -> str | None:
        """Mark the oldest PENDING run RUNNING and return its id."""
        async with self._db.session() as session:
            run = await session.scalar(
                sa.select(RunRow).where(RunRow.status == PENDING).order_by(RunRow.created_at, RunRow.id)
            )
            if run is None:
                return None
            run.status = RUNNING
            run.started_at = self._clock()
            return run.id

    async def execute_run(self, run_id: str) -> RunRow:
        """Score a claimed run and store its results, or mark it FAILED with the reason."""
        async with self._db.session() as session:
            run = await _run(session, run_id)
        spec = RunSpec.from_dict(run.spec)
        try:
            results = await self._runner.run(spec, run.endpoint)
            if not results:
                raise RunnerError("the runner scored no examples")
        except RunnerError as exc:
            return await self._fail_run(run_id, str(exc))
        except Exception as exc:  # a broken run must not take the worker down
            log.exception("eval.run_crashed", run_id=run_id)
            return await self._fail_run(run_id, f"internal error: {exc!r}")
        return await self._finish_run(run_id, spec, results)

    async def _fail_run(self, run_id: str, error: str) -> RunRow:
        async with self._db.session() as session:
            run = await _run(session, run_id)
            run.status = FAILED
            run.error = error
            run.finished_at = self._clock()
        log.warning("eval.run_failed", run_id=run_id, error=error)
        return run

    async def _finish_run(self, run_id: str, spec: RunSpec, results: list[ExampleResult]) -> RunRow:
        """1. Compute metrics; 2. decide the gate against production; 3. store everything with
        the EvalCompleted event in one transaction."""
        by_metric: dict[str, dict[str, float]] = defaultdict(dict)
        for r in results:
            by_metric[r.metric][r.example_id] = r.score
        estimates = {
            name: stats.mean_estimate(list(scores.values()), seed=spec.seed)
            for name, scores in sorted(by_metric.items())
        }
        async with self._db.session() as session:
            run = await _run(session, run_id)
            passed = await self._passes_gate(session, run, spec, by_metric)
            session.add_all(
                ExampleRow(
                    run_id=run_id,
                    example_id=r.example_id,
                    metric=r.metric,
                    score=r.score,
                    prompt=r.prompt,
                    output=r.output,
                    extracted=r.extracted,
                    target=r.target,
                )
                for r in results
            )
            session.add_all(
                MetricRow(run_id=run_id, name=name, value=e.value, ci_low=e.ci_low, ci_high=e.ci_high, n=e.n)
                for name, e in estimates.items()
            )
            run.status = SUCCEEDED
            run.example_count = len({r.example_id for r in results})
            run.passed_gate = passed
            run.finished_at = self._clock()
            await stage_event(
                session,
                events_pb2.EvalCompleted(
                    run_id=run.id,
                    suite=run.suite,
                    model=common_pb2.ModelRef(name=run.model_name, version=run.model_version),
                    metrics={name: e.value for name, e in estimates.items()},
                    spec_hash=run.spec_hash,
                    passed_gate=passed,
                ),
                producer=self._producer,
                key=run.id,
            )
        self._on_commit()
        return run

    async def _passes_gate(
        self, session: AsyncSession, run: RunRow, spec: RunSpec, scores: dict[str, dict[str, float]]
    ) -> bool:
        """The release gate: no significant regression against the production model's latest
        finished run of the same spec; passes when production has no such run."""
        holder = (await _holders(session)).get(GATE_STAGE)
        if holder is None:
            return True
        production = await session.get(ModelRow, holder.model_id)
        assert production is not None
        if (production.name, production.version) == (run.model_name, run.model_version):
            return True
        candidates = (
            await session.scalars(
                sa.select(RunRow)
                .where(
                    RunRow.model_name == production.name,
                    RunRow.model_version == production.version,
                    RunRow.suite == run.suite,
                    RunRow.status == SUCCEEDED,
                )
                .order_by(RunRow.finished_at.desc())
            )
        ).all()
        for baseline in candidates:
            if not RunSpec.from_dict(baseline.spec).differences(spec):
                comparison = _compare(
                    await _example_scores(session, baseline.id),
                    scores,
                    seed=spec.seed,
                    tolerance=_tolerance(spec.suite),
                )
                return comparison.verdict != Verdict.VERDICT_WORSE
        return True

    async def compare_runs(self, baseline_id: str, candidate_id: str) -> Comparison:
        """Paired comparison of two finished runs of the same spec (apart from the model)."""
        if not baseline_id:
            raise errors.ValidationError("baseline_run_id", "must not be empty")
        if not candidate_id:
            raise errors.ValidationError("candidate_run_id", "must not be empty")
        async with self._db.session() as session:
            baseline = await _run(session, baseline_id)
            candidate = await _run(session, candidate_id)
            for run in (baseline, candidate):
                if run.status != SUCCEEDED:
                    raise errors.ConflictError(
                        f"run {run.id} is {_status_name(run.status)}; only succeeded runs can be compared"
                    )
            spec_b, spec_c = RunSpec.from_dict(baseline.spec), RunSpec.from_dict(candidate.spec)
            differing = spec_b.differences(spec_c)
            if differing:
                detail = "; ".join(
                    f"{key}: {spec_b.to_dict()[key]!r} vs {spec_c.to_dict()[key]!r}"
                    if key != "datasets"
                    else "datasets: content hashes differ"
                    for key in differing
                )
                raise errors.ConflictError(
                    f"runs {baseline_id} and {candidate_id} are not comparable: {detail}"
                )
            return _compare(
                await _example_scores(session, baseline_id),
                await _example_scores(session, candidate_id),
                seed=spec_b.seed,
                tolerance=_tolerance(spec_b.suite),
            )


def _compare(
    baseline: dict[str, dict[str, float]],
    candidate: dict[str, dict[str, float]],
    *,
    seed: int,
    tolerance: float = 0.0,
) -> Comparison:
    """Paired comparison per metric at confidence 1 − ALPHA/m for m metrics, and its verdict."""
    metrics = sorted(baseline.keys() & candidate.keys())
    confidence = 1 - ALPHA / max(1, len(metrics))
    deltas = []
    for metric in metrics:
        ids = sorted(baseline[metric].keys() & candidate[metric].keys())
        result = stats.paired_compare(
            [baseline[metric][i] for i in ids],
            [candidate[metric][i] for i in ids],
            seed=seed,
            confidence=confidence,
        )
        deltas.append(MetricDelta(metric, result))
    frozen = tuple(deltas)
    return Comparison(frozen, verdict_of(frozen, tolerance))


async def _example_scores(session: AsyncSession, run_id: str) -> dict[str, dict[str, float]]:
    scores: dict[str, dict[str, float]] = defaultdict(dict)
    rows = await session.execute(
        sa.select(ExampleRow.metric, ExampleRow.example_id, ExampleRow.score).where(
            ExampleRow.run_id == run_id
        )
    )
    for metric, example_id, score in rows:
        scores[metric][example_id] = score
    return scores


def _status_name(status: int) -> str:
    return RunStatus.Name(status).removeprefix("RUN_STATUS_")  # type: ignore[arg-type]


async def _run(session: AsyncSession, run_id: str) -> RunRow:
    if not run_id:
        raise errors.ValidationError("run_id", "must not be empty")
    run = await session.get(RunRow, run_id)
    if run is None:
        raise errors.NotFoundError(f"run {run_id!r} not found")
    return run


async def _find_model(session: AsyncSession, name: str, version: str) -> ModelRow | None:
    return await session.scalar(sa.select(ModelRow).where(ModelRow.name == name, ModelRow.version == version))


async def _holders(session: AsyncSession) -> dict[str, StageEventRow]:
    """The current holder row of every stage: its newest promotion not rolled back."""
    rows = (
        await session.scalars(
            sa.select(StageEventRow)
            .where(StageEventRow.action == "promote", StageEventRow.rolled_back.is_(False))
            .order_by(StageEventRow.id)
        )
    ).all()
    return {row.stage: row for row in rows}


async def _model_view(session: AsyncSession, model: ModelRow) -> ModelView:
    held = [row for row in (await _holders(session)).values() if row.model_id == model.id]
    latest = max(held, key=lambda r: r.id) if held else None
    run_ids = (
        await session.scalars(
            sa.select(RunRow.id)
            .where(RunRow.model_name == model.name, RunRow.model_version == model.version)
            .order_by(RunRow.created_at)
        )
    ).all()
    return ModelView(
        model, latest.stage if latest else "", latest.traffic_percent if latest else 0, tuple(run_ids)
    )
