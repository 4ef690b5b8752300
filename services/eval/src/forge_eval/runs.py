"""Eval runs: requests, the worker that executes them, and paired comparisons.

RunSuite only validates, pins the spec and queues the run; a background worker executes queued
runs through a :class:`~forge_eval.runner.SuiteRunner`, against the run's endpoint or a model server
started for the run (:mod:`forge_eval.serving`). Every finished run is decided against the release
gate (:mod:`forge_eval.gate`) and written with its ``EvalCompleted`` event in one transaction (the
outbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import sqlalchemy as sa
import structlog
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from prometheus_client import Counter

from forge_eval import reports, stats
from forge_eval.endpoints import EndpointRegistry, normalize_endpoint
from forge_eval.gate import Comparison, Verdict, baseline_of, compare, production_comparison, suite_tolerance
from forge_eval.registry import validate_model_name, validate_version
from forge_eval.runner import ExampleResult, RunnerError, SuiteRunner
from forge_eval.serving import ModelHost, ModelServerError, local_checkpoint
from forge_eval.spec import RunSpec, SuiteCatalog, normalize_options
from forge_eval.store.registry import ModelRow, find_model
from forge_eval.store.runs import (
    ExampleRow,
    MetricRow,
    RunRow,
    RunStatus,
    example_scores,
    get_run,
    status_name,
)
from forge_kit import errors
from forge_kit.db import Database, utcnow
from forge_kit.events import stage_event
from forge_kit.validate import check_seed

log = structlog.get_logger(__name__)
EVAL_GATE = Counter(
    "forge_eval_gate_total", "Release-gate decisions of finished eval runs", ["suite", "decision"]
)
TIERS = ("full", "smoke")


class RunService:
    """Owns the runs' tables (and reads the registry's); every public method is one transaction."""

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
                model = await find_model(session, name, version)
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
                status=RunStatus.PENDING,
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
            run = await get_run(session, run_id)
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
                sa.update(RunRow)
                .where(RunRow.status == RunStatus.RUNNING)
                .values(status=RunStatus.PENDING, started_at=None)
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
            # Wait for the cancelled runs: a run cancelled while its session hands the connection
            # back must finish closing it before the worker returns (see test_eval_worker).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def claim_next_run(self) -> str | None:
        """Mark the oldest PENDING run RUNNING and return its id."""
        async with self._db.session() as session:
            run = await session.scalar(
                sa.select(RunRow)
                .where(RunRow.status == RunStatus.PENDING)
                .order_by(RunRow.created_at, RunRow.id)
            )
            if run is None:
                return None
            run.status = RunStatus.RUNNING
            run.started_at = self._clock()
            return run.id

    async def execute_run(self, run_id: str) -> RunRow:
        """Score a claimed run and store its results, or mark it FAILED with the reason. A run
        with ``serve_model`` first starts a model server for its checkpoint, which is stopped when
        scoring ends, however it ends."""
        async with self._db.session() as session:
            run = await get_run(session, run_id)
            model = await find_model(session, run.model_name, run.model_version)
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
                (await get_run(session, run.id)).endpoint = served.endpoint
            log.info("eval.model_served", run_id=run.id, endpoint=served.endpoint, checkpoint=str(checkpoint))
            yield served.endpoint, served.token

    async def _fail_run(self, run_id: str, error: str) -> RunRow:
        async with self._db.session() as session:
            run = await get_run(session, run_id)
            run.status = RunStatus.FAILED
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
            run = await get_run(session, run_id)
            found = await production_comparison(session, run, spec, by_metric)
            passed = found is None or found[2].verdict != Verdict.WORSE
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
            run.status = RunStatus.SUCCEEDED
            run.example_count = len({r.example_id for r in results})
            run.passed_gate = passed
            run.finished_at = self._clock()
            run.report_path = await self._write_report(
                f"{run.id}/report.md",
                reports.run_report(run, metric_rows, baseline_of(found)),
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
            baseline = await get_run(session, baseline_id)
            candidate = await get_run(session, candidate_id)
            for run in (baseline, candidate):
                if run.status != RunStatus.SUCCEEDED:
                    raise errors.ConflictError(
                        f"run {run.id} is {status_name(run.status)}; only succeeded runs can be compared"
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
            tolerance = suite_tolerance(spec_b.suite)
            comparison = compare(
                await example_scores(session, baseline_id),
                await example_scores(session, candidate_id),
                seed=spec_b.seed,
                tolerance=tolerance,
            )
        path = await self._write_report(
            f"compare-{baseline_id}-{candidate_id}/comparison.md",
            reports.comparison_report(
                baseline,
                candidate,
                comparison.verdict.name,
                [(d.name, d.result) for d in comparison.deltas],
                tolerance,
            ),
        )
        return Comparison(comparison.deltas, comparison.verdict, path)
