"""Eval domain logic: the model registry and release gate, run requests, run execution, comparisons.

A model version's lifecycle is ``candidate`` (registered) → ``canary`` → ``production`` →
``archived``; every change is an append-only audit event (who, when, why, and for a promotion
forced past a failing gate, that gate's report). Changes of a serving stage (canary, production)
are written with their ``ModelPromoted`` event, and every finished run with its ``EvalCompleted``
event, in one transaction (the outbox). Runs are executed by a background worker through a
:class:`~forge_eval.runner.SuiteRunner`, against the run's endpoint or a model server started for
the run (:mod:`forge_eval.serving`); RunSuite itself only validates, pins the spec and queues it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2
from forge.events.v1 import events_pb2
from prometheus_client import Counter
from sqlalchemy.ext.asyncio import AsyncSession

from forge_eval import reports, stats
from forge_eval.endpoints import EndpointRegistry, normalize_endpoint
from forge_eval.runner import ExampleResult, RunnerError, SuiteRunner
from forge_eval.scorers import SCORERS
from forge_eval.serving import ModelHost, ModelServerError, local_checkpoint
from forge_eval.spec import RunSpec, SuiteCatalog, normalize_options
from forge_eval.store import ExampleRow, MetricRow, ModelRow, RunRow, StageEventRow, utcnow
from forge_eval.tasks import load_task, shipped_tasks
from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_kit.modelref import check_name, check_version
from forge_kit.validate import MAX_URI_CHARS, check_labels, check_seed, check_text

log = structlog.get_logger(__name__)
EVAL_GATE = Counter(
    "forge_eval_gate_total", "Release-gate decisions of finished eval runs", ["suite", "decision"]
)

RunStatus = eval_pb2.RunStatus
PENDING, RUNNING = RunStatus.RUN_STATUS_PENDING, RunStatus.RUN_STATUS_RUNNING
SUCCEEDED, FAILED = RunStatus.RUN_STATUS_SUCCEEDED, RunStatus.RUN_STATUS_FAILED
Verdict = eval_pb2.Verdict
ALPHA = 0.05

CANDIDATE, CANARY, PRODUCTION, ARCHIVED = "candidate", "canary", "production", "archived"
STAGES = (CANDIDATE, CANARY, PRODUCTION, ARCHIVED)
#: Stages that serve traffic: one holder each, ``ModelPromoted`` on change, rollback possible.
SERVING = (CANARY, PRODUCTION)
#: Where a promotion may take a model from each stage (a rollback aside). Canary → canary
#: re-promotes with a new traffic share.
TRANSITIONS: dict[str, frozenset[str]] = {
    CANDIDATE: frozenset({CANARY, PRODUCTION, ARCHIVED}),
    CANARY: frozenset({CANARY, PRODUCTION, ARCHIVED}),
    PRODUCTION: frozenset(),
    ARCHIVED: frozenset(),
}
GATE_STAGE = PRODUCTION
TIERS = ("full", "smoke")


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint came from; ``parent`` is a registered (name, version)."""

    training_run_id: str = ""
    recipe_hash: str = ""
    data_hash: str = ""
    parent: tuple[str, str] | None = None


@dataclass(frozen=True)
class ModelView:
    """A registered model: its lifecycle stage, traffic share when serving, runs and parent."""

    row: ModelRow
    stage: str
    traffic_percent: int
    eval_run_ids: tuple[str, ...]
    parent: tuple[str, str] | None = None


@dataclass(frozen=True)
class StageEventView:
    """One audit event with the models it names resolved."""

    row: StageEventRow
    model: tuple[str, str]
    previous: tuple[str, str] | None


@dataclass(frozen=True)
class Promotion:
    """A promotion's or rollback's outcome: the model, the one it displaced, the audit event."""

    model: ModelView
    previous: ModelRow | None
    event: StageEventView


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
    report_path: str = ""


def validate_model_name(field: str, value: str) -> None:
    """A registry name is a :class:`~forge_kit.modelref.ModelRef`'s name."""
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    try:
        check_name(value)
    except ValueError as exc:
        raise errors.ValidationError(field, str(exc)) from None


def validate_version(field: str, value: str) -> None:
    """A registry version is a :class:`~forge_kit.modelref.ModelRef`'s version, never empty."""
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    try:
        check_version(value)
    except ValueError as exc:
        raise errors.ValidationError(field, str(exc)) from None


def validate_stage(field: str, value: str) -> None:
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    if value not in STAGES:
        raise errors.ValidationError(field, f"must be one of {', '.join(STAGES)}, got {value!r}")


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
        catalog: SuiteCatalog,
        runner: SuiteRunner,
        *,
        default_endpoint: str = "",
        producer: str = "eval",
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
        run_concurrency: int = 1,
        model_host: ModelHost | None = None,
        reports_dir: Path | None = None,
        endpoints: EndpointRegistry | None = None,
    ) -> None:
        self._db = db
        self._endpoints = endpoints or EndpointRegistry({default_endpoint: ""})
        self._catalog = catalog
        self._runner = runner
        self._default_endpoint = default_endpoint
        self._producer = producer
        self._clock = clock
        self._on_commit = on_commit
        self._run_concurrency = run_concurrency
        self._model_host = model_host
        self._reports_dir = reports_dir
        self._queued = asyncio.Event()

    # --- registry ----------------------------------------------------------------------------

    async def register_model(
        self,
        name: str,
        version: str,
        uri: str,
        labels: Mapping[str, str],
        lineage: Lineage | None = None,
        *,
        actor: str = "",
    ) -> ModelView:
        """Add a model version as a ``candidate``; an empty version takes the next integer of the
        family. The parent named in ``lineage`` must be registered."""
        validate_model_name("ref.name", name)
        if version:
            validate_version("ref.version", version)
        if not uri.strip():
            raise errors.ValidationError("uri", "must not be empty")
        check_text("uri", uri, MAX_URI_CHARS)
        check_labels("labels", labels)
        lineage = lineage or Lineage()
        for field in ("training_run_id", "recipe_hash", "data_hash"):
            if len(getattr(lineage, field)) > 128:
                raise errors.ValidationError(f"lineage.{field}", "must be at most 128 characters")
        async with self._db.session() as session:
            parent_id: int | None = None
            if lineage.parent is not None:
                parent = await _find_model(session, *lineage.parent)
                if parent is None:
                    raise errors.ValidationError(
                        "lineage.parent", f"model {':'.join(lineage.parent)} is not registered"
                    )
                parent_id = parent.id
            if not version:
                existing = (
                    await session.scalars(sa.select(ModelRow.version).where(ModelRow.name == name))
                ).all()
                version = str(max((int(v) for v in existing if v.isdigit()), default=0) + 1)
            elif await _find_model(session, name, version) is not None:
                raise errors.AlreadyExistsError(f"model {name}:{version} is already registered")
            row = ModelRow(
                name=name,
                version=version,
                uri=uri,
                labels=dict(labels),
                created_at=self._clock(),
                stage=CANDIDATE,
                training_run_id=lineage.training_run_id,
                recipe_hash=lineage.recipe_hash,
                data_hash=lineage.data_hash,
                parent_model_id=parent_id,
            )
            session.add(row)
            await session.flush()
            session.add(
                self._event(
                    "register", row, from_stage="", to_stage=CANDIDATE, actor=actor, reason="registered"
                )
            )
            return await _model_view(session, row)

    async def list_models(
        self, name: str, stage: str, page_size: int, offset: int
    ) -> tuple[list[ModelView], int]:
        query = sa.select(ModelRow)
        if name:
            query = query.where(ModelRow.name == name)
        if stage:
            validate_stage("stage", stage)
            query = query.where(ModelRow.stage == stage)
        async with self._db.session() as session:
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
        self,
        name: str,
        version: str,
        stage: str,
        *,
        traffic_percent: int,
        reason: str,
        force: bool = False,
        actor: str = "",
        admin: bool = True,
    ) -> Promotion:
        """Move ``name:version`` to ``stage`` along its lifecycle.

        1. Check the transition (canary from candidate; production from candidate or canary;
           archived from candidate or canary);
        2. canary and production need one of its finished runs to have passed the release gate;
           without one the promotion is refused unless ``force`` is set by an ``admin`` with a
           reason, and then the failing gate's report is kept with the event;
        3. the stage's previous holder is archived (production) or archived (a displaced canary);
        4. write the audit event and, for canary and production, ``ModelPromoted`` (outbox).
        """
        validate_model_name("ref.name", name)
        if not version:
            raise errors.ValidationError("ref.version", "is required to promote")
        validate_version("ref.version", version)
        validate_stage("stage", stage)
        if stage == CANDIDATE:
            raise errors.ValidationError(
                "stage", "a model is a candidate when registered; promote to canary, production or archived"
            )
        if traffic_percent > 100:
            raise errors.ValidationError("traffic_percent", "must be between 0 and 100")
        if force:
            if not admin:
                raise errors.PermissionDeniedError(
                    f"forcing a promotion past the release gate needs an admin token; {actor or 'the caller'} is not an admin"
                )
            if stage not in SERVING:
                raise errors.ValidationError(
                    "force", "only canary and production have a release gate to force"
                )
            if not reason.strip():
                raise errors.ValidationError("reason", "is required to force a promotion (it is audited)")
        traffic = traffic_percent or 100
        async with self._db.session() as session:
            model = await _find_model(session, name, version)
            if model is None:
                raise errors.NotFoundError(f"model {name}:{version} is not registered")
            holder = (await _holders(session)).get(stage) if stage in SERVING else None
            if holder is not None and holder.model_id == model.id and holder.traffic_percent == traffic:
                # Already done (a retried call whose answer was lost): report it, change nothing.
                return Promotion(await _model_view(session, model), None, await _event_view(session, holder))
            allowed = TRANSITIONS[model.stage]
            if stage not in allowed:
                raise errors.ConflictError(
                    f"model {name}:{version} is {model.stage}; it cannot move to {stage} "
                    f"(from {model.stage}: {', '.join(sorted(allowed)) or 'only a rollback'})"
                )
            gate_run_id, gate_report, forced = "", "", False
            if stage in SERVING:
                gate_run_id, report = await self._gate(session, model)
                if not gate_run_id:
                    if not force:
                        raise errors.ConflictError(
                            f"release gate: {report['summary']}; an admin may force it (force with a reason)"
                        )
                    forced = True
                    gate_report = json.dumps(report, sort_keys=True)
            previous = (
                await session.get(ModelRow, holder.model_id)
                if holder is not None and holder.model_id != model.id
                else None
            )
            if forced:
                why = reason
            else:
                why = reason or (f"gate passed: eval run {gate_run_id}" if gate_run_id else stage)
            now_actor = actor or "anonymous"
            if previous is not None:
                session.add(
                    self._event(
                        "archive",
                        previous,
                        from_stage=previous.stage,
                        to_stage=ARCHIVED,
                        actor=now_actor,
                        reason=f"replaced in {stage} by {name}:{version}",
                    )
                )
                previous.stage = ARCHIVED
            event = self._event(
                "archive" if stage == ARCHIVED else "promote",
                model,
                from_stage=model.stage,
                to_stage=stage,
                actor=now_actor,
                reason=why,
                previous=previous,
                traffic_percent=traffic if stage in SERVING else 0,
                gate_run_id=gate_run_id,
                forced=forced,
                gate_report=gate_report,
            )
            session.add(event)
            model.stage = stage
            await session.flush()
            if stage in SERVING:
                await self._stage_promotion(session, model, stage, previous, traffic, why, is_rollback=False)
            view = await _model_view(session, model)
            record = await _event_view(session, event)
        if forced:
            log.warning(
                "eval.promotion_forced", model=f"{name}:{version}", stage=stage, actor=now_actor, reason=why
            )
        self._on_commit()
        return Promotion(view, previous, record)

    async def rollback_model(self, stage: str, reason: str, *, actor: str = "") -> Promotion:
        """Give ``stage`` back to the model that held it before its current holder, if that model
        was archived by being replaced; the current holder is archived."""
        validate_stage("stage", stage)
        if stage not in SERVING:
            raise errors.ValidationError("stage", "only canary and production can be rolled back")
        async with self._db.session() as session:
            holder = (await _holders(session)).get(stage)
            if holder is None:
                raise errors.ConflictError(f"stage {stage!r} has no model to roll back")
            removed = await session.get(ModelRow, holder.model_id)
            assert removed is not None
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
            for row in stack:
                if row.model_id == removed.id:
                    row.rolled_back = True
            stack = [row for row in stack if row.model_id != removed.id]
            if not stack:
                raise errors.ConflictError(f"stage {stage!r} has no earlier model to roll back to")
            restored = stack[-1]
            model = await session.get(ModelRow, restored.model_id)
            assert model is not None
            if model.stage != ARCHIVED:
                raise errors.ConflictError(
                    f"the previous holder of {stage!r}, {model.name}:{model.version}, is now {model.stage}; "
                    "archive the current holder or promote another model instead"
                )
            now_actor = actor or "anonymous"
            why = reason or f"rolled back from {removed.name}:{removed.version}"
            session.add(
                self._event(
                    "archive",
                    removed,
                    from_stage=removed.stage,
                    to_stage=ARCHIVED,
                    actor=now_actor,
                    reason=f"rolled back: {why}",
                )
            )
            removed.stage = ARCHIVED
            event = self._event(
                "rollback",
                model,
                from_stage=model.stage,
                to_stage=stage,
                actor=now_actor,
                reason=why,
                previous=removed,
                traffic_percent=restored.traffic_percent,
            )
            session.add(event)
            model.stage = stage
            await session.flush()
            await self._stage_promotion(
                session, model, stage, removed, restored.traffic_percent, why, is_rollback=True
            )
            view = await _model_view(session, model)
            record = await _event_view(session, event)
        self._on_commit()
        return Promotion(view, removed, record)

    async def list_stage_events(
        self,
        model_name: str,
        model_version: str,
        stage: str,
        *,
        forced_only: bool,
        page_size: int,
        offset: int,
    ) -> tuple[list[StageEventView], int]:
        """The audit trail, newest first."""
        if model_version and not model_name:
            raise errors.ValidationError("model_version", "needs model_name")
        if stage:
            validate_stage("stage", stage)
        query = sa.select(StageEventRow)
        if model_name:
            models = sa.select(ModelRow.id).where(ModelRow.name == model_name)
            if model_version:
                models = models.where(ModelRow.version == model_version)
            query = query.where(StageEventRow.model_id.in_(models))
        if stage:
            query = query.where(StageEventRow.stage == stage)
        if forced_only:
            query = query.where(StageEventRow.forced.is_(True))
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(query.order_by(StageEventRow.id.desc()).offset(offset).limit(page_size))
            ).all()
            return [await _event_view(session, r) for r in rows], total

    def _event(
        self,
        action: str,
        model: ModelRow,
        *,
        from_stage: str,
        to_stage: str,
        actor: str,
        reason: str,
        previous: ModelRow | None = None,
        traffic_percent: int = 0,
        gate_run_id: str = "",
        forced: bool = False,
        gate_report: str = "",
    ) -> StageEventRow:
        return StageEventRow(
            stage=to_stage,
            from_stage=from_stage,
            action=action,
            model_id=model.id,
            previous_model_id=previous.id if previous else None,
            traffic_percent=traffic_percent,
            reason=reason,
            gate_run_id=gate_run_id,
            rolled_back=False,
            actor=actor or "anonymous",
            forced=forced,
            gate_report=gate_report,
            created_at=self._clock(),
        )

    async def _gate(self, session: AsyncSession, model: ModelRow) -> tuple[str, dict[str, Any]]:
        """The newest finished run of ``model`` that passed the release gate, or "" with the gate's
        state: the model's latest runs, and how the newest finished one compares with production."""
        runs = (
            await session.scalars(
                sa.select(RunRow)
                .where(RunRow.model_name == model.name, RunRow.model_version == model.version)
                .order_by(RunRow.created_at.desc(), RunRow.id)
            )
        ).all()
        passing = [r for r in runs if r.status == SUCCEEDED and r.passed_gate]
        ref = f"{model.name}:{model.version}"
        if passing:
            return passing[0].id, {}
        if not runs:
            summary = f"model {ref} has no eval runs"
        else:
            listed = "; ".join(
                f"{r.id} ({r.suite}, {r.tier}) {_status_name(r.status)}"
                + (": failed the gate" if r.status == SUCCEEDED else f": {r.error}" if r.error else "")
                for r in runs[:5]
            )
            summary = f"model {ref} has no finished eval run that passed the gate [{listed}]"
        report: dict[str, Any] = {"model": ref, "summary": summary, "runs": [], "comparison": None}
        for run in runs[:10]:
            metrics = (await session.scalars(sa.select(MetricRow).where(MetricRow.run_id == run.id))).all()
            report["runs"].append(
                {
                    "run_id": run.id,
                    "suite": run.suite,
                    "tier": run.tier,
                    "status": _status_name(run.status),
                    "passed_gate": run.passed_gate,
                    "error": run.error,
                    "spec_hash": run.spec_hash,
                    "metrics": {m.name: [m.value, m.ci_low, m.ci_high] for m in metrics},
                }
            )
        finished = next((r for r in runs if r.status == SUCCEEDED), None)
        if finished is not None:
            found = await self._production_comparison(
                session,
                finished,
                RunSpec.from_dict(finished.spec),
                await _example_scores(session, finished.id),
            )
            if found is not None:
                production, baseline, comparison = found
                report["comparison"] = {
                    "candidate_run_id": finished.id,
                    "baseline_run_id": baseline.id,
                    "production": f"{production.name}:{production.version}",
                    "verdict": _verdict_name(comparison.verdict),
                    "deltas": {
                        d.name: {
                            "delta": d.result.delta,
                            "ci": [d.result.ci_low, d.result.ci_high],
                            "p_value": d.result.p_value,
                            "n": d.result.n,
                        }
                        for d in comparison.deltas
                    },
                }
        return "", report

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
        tier: str = "",
        serve_model: bool = False,
        admin: bool = True,
    ) -> RunRow:
        """Validate, pin the spec and queue the run (PENDING); the worker executes it. With
        ``serve_model`` the run's endpoint is a model server started from the model's registered
        checkpoint when the run executes. Otherwise the endpoint must be a registered one
        (:mod:`forge_eval.endpoints`) unless the caller is an ``admin``; an unregistered endpoint's
        run carries no credential."""
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
        check_seed("seed", seed)  # it becomes the model server's sampling seed
        tier = tier or "full"
        if tier not in TIERS:
            raise errors.ValidationError("tier", f"must be one of {', '.join(TIERS)}, got {tier!r}")
        if serve_model:
            if endpoint:
                raise errors.ValidationError(
                    "endpoint", "must be empty with serve_model: the run queries the model server eval starts"
                )
            if self._model_host is None:
                raise errors.ValidationError(
                    "serve_model", "this eval service is not configured to start model servers"
                )
        else:
            endpoint = endpoint or self._default_endpoint
            if not endpoint:
                raise errors.ValidationError(
                    "endpoint", "is required: no default model endpoint is configured"
                )
            normalize_endpoint(endpoint)
            if not admin and not self._endpoints.is_registered(endpoint):
                raise errors.PermissionDeniedError(
                    f"endpoint {endpoint[:200]!r} is not a registered model endpoint "
                    f"(registered: {', '.join(self._endpoints.urls()) or 'none'}); only an admin may "
                    "run against another address, and such a run carries no credential"
                )
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
            if serve_model:
                model = await _find_model(session, name, version)
                if model is None:
                    raise errors.ValidationError("model", f"{name}:{version} must be registered to be served")
                if local_checkpoint(model.uri) is None:
                    raise errors.ValidationError(
                        "serve_model",
                        f"{name}:{version}'s uri {model.uri!r} is not a local checkpoint folder with a config.json",
                    )
            spec = RunSpec(
                suite=suite,
                datasets=datasets,
                model_name=name,
                model_version=version,
                sampling=sampling,
                seed=seed,
                limit=limit,
                scorer_version=self._runner.scorer_version(suite),
                tier=tier,
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
                tier=tier,
                serve_model=serve_model,
                report_path="",
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
        self,
        suite: str,
        model_name: str,
        page_size: int,
        offset: int,
        *,
        model_version: str = "",
        created_after: dt.datetime | None = None,
        created_before: dt.datetime | None = None,
    ) -> tuple[list[tuple[RunRow, list[MetricRow]]], int]:
        """Runs by suite, checkpoint (model name and version) and date, newest first."""
        if model_version and not model_name:
            raise errors.ValidationError("model_version", "needs model_name")
        query = sa.select(RunRow)
        if suite:
            query = query.where(RunRow.suite == suite)
        if model_name:
            query = query.where(RunRow.model_name == model_name)
        if model_version:
            query = query.where(RunRow.model_version == model_version)
        if created_after is not None:
            query = query.where(RunRow.created_at >= created_after)
        if created_before is not None:
            query = query.where(RunRow.created_at < created_before)
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
        """Score a claimed run and store its results, or mark it FAILED with the reason. A run
        with ``serve_model`` first starts a model server for its checkpoint, which is stopped when
        scoring ends, however it ends."""
        async with self._db.session() as session:
            run = await _run(session, run_id)
            model = await _find_model(session, run.model_name, run.model_version)
        spec = RunSpec.from_dict(run.spec)
        try:
            async with self._endpoint(run, model) as (endpoint, token):
                results = await self._runner.run(spec, endpoint, token=token)
            if not results:
                raise RunnerError("the runner scored no examples")
        except (RunnerError, ModelServerError) as exc:
            return await self._fail_run(run_id, str(exc))
        except Exception as exc:  # a broken run must not take the worker down
            log.exception("eval.run_crashed", run_id=run_id)
            return await self._fail_run(run_id, f"internal error: {exc!r}")
        return await self._finish_run(run_id, spec, results)

    @asynccontextmanager
    async def _endpoint(self, run: RunRow, model: ModelRow | None) -> AsyncIterator[tuple[str, str | None]]:
        """The run's endpoint and the token bound to it (empty for an unregistered endpoint),
        serving the checkpoint if asked."""
        if not run.serve_model:
            yield run.endpoint, self._endpoints.credential(run.endpoint)
            return
        checkpoint = local_checkpoint(model.uri) if model is not None else None
        if self._model_host is None or model is None or checkpoint is None:
            raise RunnerError(
                f"cannot serve {run.model_name}:{run.model_version}: "
                + (
                    "no model host is configured"
                    if self._model_host is None
                    else "its checkpoint folder is gone"
                )
            )
        async with self._model_host.serve(model.name, model.version, checkpoint) as served:
            async with self._db.session() as session:
                (await _run(session, run.id)).endpoint = served.endpoint
            log.info("eval.model_served", run_id=run.id, endpoint=served.endpoint, checkpoint=str(checkpoint))
            yield served.endpoint, served.token

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
            found = await self._production_comparison(session, run, spec, by_metric)
            passed = found is None or found[2].verdict != Verdict.VERDICT_WORSE
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
            metric_rows = [
                MetricRow(run_id=run_id, name=name, value=e.value, ci_low=e.ci_low, ci_high=e.ci_high, n=e.n)
                for name, e in estimates.items()
            ]
            session.add_all(metric_rows)
            run.status = SUCCEEDED
            run.example_count = len({r.example_id for r in results})
            run.passed_gate = passed
            run.finished_at = self._clock()
            run.report_path = await self._write_report(
                f"{run.id}/report.md",
                reports.run_report(run, metric_rows, _baseline(found)),
            )
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
        EVAL_GATE.labels(run.suite, "passed" if passed else "blocked").inc()
        return run

    async def _production_comparison(
        self, session: AsyncSession, run: RunRow, spec: RunSpec, scores: dict[str, dict[str, float]]
    ) -> tuple[ModelRow, RunRow, Comparison] | None:
        """The release gate's comparison: ``run`` against the production model's latest finished
        run of the same spec; None when there is no production model (or it is this model) or
        it has no such run, and then the gate passes."""
        holder = (await _holders(session)).get(GATE_STAGE)
        if holder is None:
            return None
        production = await session.get(ModelRow, holder.model_id)
        assert production is not None
        if (production.name, production.version) == (run.model_name, run.model_version):
            return None
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
                return production, baseline, comparison
        return None

    async def _write_report(self, name: str, text: str) -> str:
        """Write a Markdown report under ``reports_dir``; its path, or "" when reports are off."""
        if self._reports_dir is None:
            return ""
        path = self._reports_dir / name

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

        await asyncio.to_thread(write)
        return str(path)

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
            tolerance = _tolerance(spec_b.suite)
            comparison = _compare(
                await _example_scores(session, baseline_id),
                await _example_scores(session, candidate_id),
                seed=spec_b.seed,
                tolerance=tolerance,
            )
        path = await self._write_report(
            f"compare-{baseline_id}-{candidate_id}/comparison.md",
            reports.comparison_report(
                baseline,
                candidate,
                _verdict_name(comparison.verdict),
                [(d.name, d.result) for d in comparison.deltas],
                tolerance,
            ),
        )
        return Comparison(comparison.deltas, comparison.verdict, path)


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


def _verdict_name(verdict: int) -> str:
    return Verdict.Name(verdict).removeprefix("VERDICT_")  # type: ignore[arg-type]


def _baseline(found: tuple[ModelRow, RunRow, Comparison] | None) -> reports.Baseline | None:
    if found is None:
        return None
    production, run, comparison = found
    return reports.Baseline(
        f"{production.name}:{production.version}",
        run.id,
        _verdict_name(comparison.verdict),
        [(d.name, d.result) for d in comparison.deltas],
    )


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
    """The current holder row of every serving stage: its newest promotion not rolled back whose
    model is still in that stage (a canary promoted to production no longer holds canary)."""
    rows = (
        await session.scalars(
            sa.select(StageEventRow)
            .join(ModelRow, ModelRow.id == StageEventRow.model_id)
            .where(
                StageEventRow.action == "promote",
                StageEventRow.rolled_back.is_(False),
                StageEventRow.stage == ModelRow.stage,
            )
            .order_by(StageEventRow.id)
        )
    ).all()
    return {row.stage: row for row in rows}


async def _model_view(session: AsyncSession, model: ModelRow) -> ModelView:
    holder = (await _holders(session)).get(model.stage)
    traffic = holder.traffic_percent if holder is not None and holder.model_id == model.id else 0
    run_ids = (
        await session.scalars(
            sa.select(RunRow.id)
            .where(RunRow.model_name == model.name, RunRow.model_version == model.version)
            .order_by(RunRow.created_at)
        )
    ).all()
    parent = await session.get(ModelRow, model.parent_model_id) if model.parent_model_id else None
    return ModelView(
        model,
        model.stage,
        traffic,
        tuple(run_ids),
        (parent.name, parent.version) if parent is not None else None,
    )


async def _event_view(session: AsyncSession, row: StageEventRow) -> StageEventView:
    model = await session.get(ModelRow, row.model_id)
    assert model is not None
    previous = await session.get(ModelRow, row.previous_model_id) if row.previous_model_id else None
    return StageEventView(
        row, (model.name, model.version), (previous.name, previous.version) if previous else None
    )
