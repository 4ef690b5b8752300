"""gRPC servicer of ``forge.feedback.v1.PreferenceFeedbackService``: translation only."""

from __future__ import annotations

import datetime as dt

import grpc
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from google.protobuf import timestamp_pb2

from forge_kit import errors
from forge_kit.paging import decode_page, page_info
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import ComparisonRow, RewardModelRow


def _ts(value: dt.datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.replace(tzinfo=dt.UTC))
    return stamp


def _model_ref(source: str) -> common_pb2.ModelRef:
    return common_pb2.ModelRef(name=source)


def comparison_to_proto(row: ComparisonRow) -> feedback_pb2.Comparison:
    return feedback_pb2.Comparison(
        id=row.id,
        prompt=row.prompt,
        response_a=feedback_pb2.Response(
            id=row.response_a_id, text=row.response_a_text, model=_model_ref(row.response_a_model)
        ),
        response_b=feedback_pb2.Response(
            id=row.response_b_id, text=row.response_b_text, model=_model_ref(row.response_b_model)
        ),
    )


def reward_model_to_proto(row: RewardModelRow) -> feedback_pb2.RewardModel:
    return feedback_pb2.RewardModel(
        ref=common_pb2.ModelRef(name=row.name, version=row.version),
        uri=row.uri,
        metrics=dict(row.metrics),
        created_at=_ts(row.created_at),
    )


class FeedbackApi(feedback_pb2_grpc.PreferenceFeedbackServiceServicer):
    """Translates PreferenceFeedbackService RPCs to :class:`FeedbackService` calls."""

    def __init__(self, service: FeedbackService, *, max_page_size: int) -> None:
        self._service = service
        self._max_page_size = max_page_size

    async def GetNextComparison(
        self, request: feedback_pb2.GetNextComparisonRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.GetNextComparisonResponse:
        row = await self._service.next_comparison(request.rater_id)
        return feedback_pb2.GetNextComparisonResponse(comparison=comparison_to_proto(row) if row else None)

    async def SubmitPreference(
        self, request: feedback_pb2.SubmitPreferenceRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.SubmitPreferenceResponse:
        row = await self._service.submit_preference(
            request.comparison_id, request.rater_id, request.choice, request.confidence, request.rationale
        )
        return feedback_pb2.SubmitPreferenceResponse(preference_id=row.id)

    async def ListRewardModels(
        self, request: feedback_pb2.ListRewardModelsRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.ListRewardModelsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        rows, total = await self._service.list_reward_models(request.name, size, offset)
        return feedback_pb2.ListRewardModelsResponse(
            reward_models=[reward_model_to_proto(r) for r in rows], page=page_info(offset, len(rows), total)
        )

    async def RegisterRewardModel(
        self, request: feedback_pb2.RegisterRewardModelRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.RegisterRewardModelResponse:
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        row = await self._service.register_reward_model(
            request.ref.name, request.ref.version, request.uri, request.metrics
        )
        return feedback_pb2.RegisterRewardModelResponse(reward_model=reward_model_to_proto(row))
