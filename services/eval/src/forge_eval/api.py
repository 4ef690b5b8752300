"""gRPC servicer of ``forge.eval.v1.EvalService``: translation only.

Who called comes from the kit's interceptor (:func:`forge_kit.grpckit.current_principal`): the
service token is the ``service`` admin, and :func:`named_tokens` maps the tokens of the
``ADMIN_TOKENS`` and ``USER_TOKENS`` settings to their names. The registry records the caller's
name on every change and lets only an admin force a promotion.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Mapping

import grpc
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from google.protobuf import timestamp_pb2

from forge_eval.registry import Lineage, ModelRegistry, ModelView, StageEventView
from forge_eval.rollout import decide_rollout
from forge_eval.runs import RunService
from forge_eval.store.registry import ModelRow
from forge_eval.store.runs import MetricRow, RunRow
from forge_kit import errors
from forge_kit.grpckit import Authenticator, Principal, current_principal, timestamp_field
from forge_kit.paging import decode_page, page_info


def named_tokens(admins: Mapping[str, str], users: Mapping[str, str]) -> Authenticator:
    """An authenticator for named tokens: ``admins`` and ``users`` map a name to its token."""
    known = [(token, Principal(name=name, role="admin")) for name, token in admins.items() if token] + [
        (token, Principal(name=name, role="user")) for name, token in users.items() if token
    ]

    def authenticate(presented: str) -> Principal | None:
        found = None
        for token, principal in known:  # compare with every token: no early exit to time
            if secrets.compare_digest(presented.encode(), token.encode()):
                found = principal
        return found

    return authenticate


def _caller() -> tuple[str, bool]:
    """(name, is admin) of the caller; with auth off, an anonymous admin."""
    principal = current_principal()
    if principal is None:
        return "anonymous", True
    return principal.name, principal.is_admin


def _naive(value: dt.datetime | None) -> dt.datetime | None:
    """UTC without its zone, as the store keeps times."""
    return value.replace(tzinfo=None) if value is not None else None


def _ts(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.replace(tzinfo=dt.UTC))
    return stamp


def ref_of(model: ModelRow) -> common_pb2.ModelRef:
    return common_pb2.ModelRef(name=model.name, version=model.version)


def model_to_proto(view: ModelView) -> eval_pb2.RegisteredModel:
    row = view.row
    lineage = eval_pb2.Lineage(
        training_run_id=row.training_run_id, recipe_hash=row.recipe_hash, data_hash=row.data_hash
    )
    if view.parent is not None:
        lineage.parent.CopyFrom(common_pb2.ModelRef(name=view.parent[0], version=view.parent[1]))
    return eval_pb2.RegisteredModel(
        ref=ref_of(row),
        uri=row.uri,
        stage=view.stage,
        created_at=_ts(row.created_at),
        eval_run_ids=list(view.eval_run_ids),
        traffic_percent=view.traffic_percent,
        labels=dict(row.labels),
        lineage=lineage,
    )


def event_to_proto(view: StageEventView) -> eval_pb2.StageEvent:
    row = view.row
    event = eval_pb2.StageEvent(
        event_id=row.id,
        action=row.action,
        model=common_pb2.ModelRef(name=view.model[0], version=view.model[1]),
        from_stage=row.from_stage,
        to_stage=row.stage,
        traffic_percent=row.traffic_percent,
        reason=row.reason,
        actor=row.actor,
        forced=row.forced,
        gate_run_id=row.gate_run_id,
        gate_report=row.gate_report,
        created_at=_ts(row.created_at),
        evidence=row.evidence,
    )
    if view.previous is not None:
        event.previous.CopyFrom(common_pb2.ModelRef(name=view.previous[0], version=view.previous[1]))
    return event


def run_to_proto(run: RunRow, metrics: list[MetricRow]) -> eval_pb2.EvalRun:
    return eval_pb2.EvalRun(
        run_id=run.id,
        suite=run.suite,
        model=common_pb2.ModelRef(name=run.model_name, version=run.model_version),
        endpoint=run.endpoint,
        status=int(run.status),  # type: ignore[arg-type]  # RunStatus keeps the proto's numbers
        metrics=[
            eval_pb2.Metric(name=m.name, value=m.value, ci_low=m.ci_low, ci_high=m.ci_high, n=m.n)
            for m in metrics
        ],
        example_count=run.example_count,
        spec_hash=run.spec_hash,
        error=run.error,
        created_at=_ts(run.created_at),
        finished_at=_ts(run.finished_at),
        passed_gate=run.passed_gate,
        tier=run.tier,
        serve_model=run.serve_model,
        report_path=run.report_path,
    )


class EvalApi(eval_pb2_grpc.EvalServiceServicer):
    """Translates EvalService RPCs to calls of the :class:`ModelRegistry` (models, stages, history)
    and the :class:`RunService` (runs, comparisons)."""

    def __init__(self, registry: ModelRegistry, runs: RunService, *, max_page_size: int) -> None:
        self._registry = registry
        self._runs = runs
        self._max_page_size = max_page_size

    async def RunSuite(
        self, request: eval_pb2.RunSuiteRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.RunSuiteResponse:
        if not request.HasField("model"):
            raise errors.ValidationError("model", "is required")
        run = await self._runs.run_suite(
            request.suite,
            request.model.name,
            request.model.version,
            endpoint=request.endpoint,
            limit=request.limit,
            seed=request.seed,
            options=request.options,
            tier=request.tier,
            serve_model=request.serve_model,
            admin=_caller()[1],
        )
        return eval_pb2.RunSuiteResponse(run_id=run.id, spec_hash=run.spec_hash)

    async def GetRun(
        self, request: eval_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.GetRunResponse:
        run, metrics = await self._runs.get_run(request.run_id)
        return eval_pb2.GetRunResponse(run=run_to_proto(run, metrics))

    async def ListRuns(
        self, request: eval_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.ListRunsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        runs, total = await self._runs.list_runs(
            request.suite,
            request.model_name,
            size,
            offset,
            model_version=request.model_version,
            created_after=_naive(timestamp_field(request, "created_after")),
            created_before=_naive(timestamp_field(request, "created_before")),
        )
        return eval_pb2.ListRunsResponse(
            runs=[run_to_proto(r, m) for r, m in runs], page=page_info(offset, len(runs), total)
        )

    async def CompareRuns(
        self, request: eval_pb2.CompareRunsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.CompareRunsResponse:
        comparison = await self._runs.compare_runs(request.baseline_run_id, request.candidate_run_id)
        return eval_pb2.CompareRunsResponse(
            deltas=[
                eval_pb2.MetricDelta(
                    name=d.name,
                    baseline=d.result.baseline,
                    candidate=d.result.candidate,
                    delta=d.result.delta,
                    ci_low=d.result.ci_low,
                    ci_high=d.result.ci_high,
                    p_value=d.result.p_value,
                    n=d.result.n,
                )
                for d in comparison.deltas
            ],
            verdict=int(comparison.verdict),  # type: ignore[arg-type]  # Verdict keeps the proto's numbers
            report_path=comparison.report_path,
        )

    async def ListModels(
        self, request: eval_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.ListModelsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        models, total = await self._registry.list_models(request.name, request.stage, size, offset)
        return eval_pb2.ListModelsResponse(
            models=[model_to_proto(m) for m in models], page=page_info(offset, len(models), total)
        )

    async def RegisterModel(
        self, request: eval_pb2.RegisterModelRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.RegisterModelResponse:
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        lineage = request.lineage
        parent = None
        if lineage.HasField("parent"):
            if not lineage.parent.name or not lineage.parent.version:
                raise errors.ValidationError("lineage.parent", "needs a name and a version")
            parent = (lineage.parent.name, lineage.parent.version)
        view = await self._registry.register_model(
            request.ref.name,
            request.ref.version,
            request.uri,
            request.labels,
            Lineage(lineage.training_run_id, lineage.recipe_hash, lineage.data_hash, parent),
            actor=_caller()[0],
        )
        return eval_pb2.RegisterModelResponse(model=model_to_proto(view))

    async def PromoteModel(
        self, request: eval_pb2.PromoteModelRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.PromoteModelResponse:
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        actor, admin = _caller()
        done = await self._registry.promote_model(
            request.ref.name,
            request.ref.version,
            request.stage,
            traffic_percent=request.traffic_percent,
            reason=request.reason,
            force=request.force,
            actor=actor,
            admin=admin,
        )
        return eval_pb2.PromoteModelResponse(
            model=model_to_proto(done.model),
            previous=ref_of(done.previous) if done.previous else None,
            event=event_to_proto(done.event),
        )

    async def RollbackModel(
        self, request: eval_pb2.RollbackModelRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.RollbackModelResponse:
        done = await self._registry.rollback_model(request.stage, request.reason, actor=_caller()[0])
        assert done.previous is not None
        return eval_pb2.RollbackModelResponse(
            model=model_to_proto(done.model),
            rolled_back=ref_of(done.previous),
            event=event_to_proto(done.event),
        )

    async def DecideRollout(
        self, request: eval_pb2.DecideRolloutRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.DecideRolloutResponse:
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        actor, admin = _caller()
        done = await decide_rollout(
            self._registry,
            request.ref.name,
            request.ref.version,
            request.decision,
            request.reason,
            request.evidence,
            actor=actor,
            admin=admin,
        )
        return eval_pb2.DecideRolloutResponse(
            event=event_to_proto(done.event), model=model_to_proto(done.model)
        )

    async def ListStageEvents(
        self, request: eval_pb2.ListStageEventsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.ListStageEventsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        events, total = await self._registry.list_stage_events(
            request.model_name,
            request.model_version,
            request.stage,
            forced_only=request.forced_only,
            page_size=size,
            offset=offset,
        )
        return eval_pb2.ListStageEventsResponse(
            events=[event_to_proto(e) for e in events], page=page_info(offset, len(events), total)
        )
