"""gRPC servicer of ``forge.eval.v1.EvalService``: translation only."""

from __future__ import annotations

import datetime as dt

import grpc
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from google.protobuf import timestamp_pb2

from forge_eval.service import EvalService, ModelView
from forge_eval.store import MetricRow, ModelRow, RunRow
from forge_kit import errors
from forge_kit.paging import decode_page, page_info


def _ts(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.replace(tzinfo=dt.UTC))
    return stamp


def ref_of(model: ModelRow) -> common_pb2.ModelRef:
    return common_pb2.ModelRef(name=model.name, version=model.version)


def model_to_proto(view: ModelView) -> eval_pb2.RegisteredModel:
    return eval_pb2.RegisteredModel(
        ref=ref_of(view.row),
        uri=view.row.uri,
        stage=view.stage,
        created_at=_ts(view.row.created_at),
        eval_run_ids=list(view.eval_run_ids),
        traffic_percent=view.traffic_percent,
        labels=dict(view.row.labels),
    )


def run_to_proto(run: RunRow, metrics: list[MetricRow]) -> eval_pb2.EvalRun:
    return eval_pb2.EvalRun(
        run_id=run.id,
        suite=run.suite,
        model=common_pb2.ModelRef(name=run.model_name, version=run.model_version),
        endpoint=run.endpoint,
        status=run.status,  # type: ignore[arg-type]
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
    )


class EvalApi(eval_pb2_grpc.EvalServiceServicer):
    """Translates EvalService RPCs to :class:`EvalService` calls."""

    def __init__(self, service: EvalService, *, max_page_size: int) -> None:
        self._service = service
        self._max_page_size = max_page_size

    async def RunSuite(
        self, request: eval_pb2.RunSuiteRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.RunSuiteResponse:
        if not request.HasField("model"):
            raise errors.ValidationError("model", "is required")
        run = await self._service.run_suite(
            request.suite,
            request.model.name,
            request.model.version,
            endpoint=request.endpoint,
            limit=request.limit,
            seed=request.seed,
            options=request.options,
        )
        return eval_pb2.RunSuiteResponse(run_id=run.id, spec_hash=run.spec_hash)

    async def GetRun(
        self, request: eval_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.GetRunResponse:
        run, metrics = await self._service.get_run(request.run_id)
        return eval_pb2.GetRunResponse(run=run_to_proto(run, metrics))

    async def ListRuns(
        self, request: eval_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.ListRunsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        runs, total = await self._service.list_runs(request.suite, request.model_name, size, offset)
        return eval_pb2.ListRunsResponse(
            runs=[run_to_proto(r, m) for r, m in runs], page=page_info(offset, len(runs), total)
        )

    async def CompareRuns(
        self, request: eval_pb2.CompareRunsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.CompareRunsResponse:
        comparison = await self._service.compare_runs(request.baseline_run_id, request.candidate_run_id)
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
            verdict=comparison.verdict,  # type: ignore[arg-type]
        )

    async def ListModels(
        self, request: eval_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.ListModelsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        models, total = await self._service.list_models(request.name, request.stage, size, offset)
        return eval_pb2.ListModelsResponse(
            models=[model_to_proto(m) for m in models], page=page_info(offset, len(models), total)
        )

    async def RegisterModel(
        self, request: eval_pb2.RegisterModelRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.RegisterModelResponse:
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        view = await self._service.register_model(
            request.ref.name, request.ref.version, request.uri, request.labels
        )
        return eval_pb2.RegisterModelResponse(model=model_to_proto(view))

    async def PromoteModel(
        self, request: eval_pb2.PromoteModelRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.PromoteModelResponse:
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        view, previous = await self._service.promote_model(
            request.ref.name,
            request.ref.version,
            request.stage,
            require_gate=request.require_gate,
            traffic_percent=request.traffic_percent,
            reason=request.reason,
        )
        return eval_pb2.PromoteModelResponse(
            model=model_to_proto(view), previous=ref_of(previous) if previous else None
        )

    async def RollbackModel(
        self, request: eval_pb2.RollbackModelRequest, context: grpc.aio.ServicerContext
    ) -> eval_pb2.RollbackModelResponse:
        view, removed = await self._service.rollback_model(request.stage, request.reason)
        return eval_pb2.RollbackModelResponse(model=model_to_proto(view), rolled_back=ref_of(removed))
