"""gRPC servicer of ``forge.feedback.v1.PreferenceFeedbackService``: translation only."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import grpc
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from google.protobuf import timestamp_pb2

from forge_kit import errors
from forge_kit.grpckit import current_principal, require_admin, timestamp_field
from forge_kit.modelref import label
from forge_kit.paging import decode_page, page_info
from forge_preference_feedback.quality import QualityPolicy
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry, heldout_of
from forge_preference_feedback.rounds import RlhfRounds, RoundReport, round_fields
from forge_preference_feedback.service import FeedbackService, NewComparison, StoredSnapshot
from forge_preference_feedback.store import ComparisonRow, RewardModelRow, RlhfRoundRow

STATUS_TO_PROTO = {
    "candidate": feedback_pb2.REWARD_MODEL_STATUS_CANDIDATE,
    "active": feedback_pb2.REWARD_MODEL_STATUS_ACTIVE,
    "retired": feedback_pb2.REWARD_MODEL_STATUS_RETIRED,
}
STATUS_FROM_PROTO = {v: k for k, v in STATUS_TO_PROTO.items()}


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
    heldout = heldout_of(row)
    message = feedback_pb2.RewardModel(
        ref=common_pb2.ModelRef(name=row.name, version=row.version),
        uri=row.uri,
        metrics=dict(row.metrics),
        created_at=_ts(row.created_at),
        status=STATUS_TO_PROTO.get(row.status, feedback_pb2.REWARD_MODEL_STATUS_UNSPECIFIED),
        snapshot_id=row.snapshot_id,
        backbone=row.backbone,
        registered_by=row.registered_by,
        status_changed_by=row.status_changed_by,
    )
    if heldout is not None:
        message.heldout.CopyFrom(
            feedback_pb2.PairwiseAccuracy(
                accuracy=heldout.accuracy,
                ci95_low=heldout.ci95_low,
                ci95_high=heldout.ci95_high,
                n=heldout.n,
                interval=heldout.interval,
            )
        )
    if row.status_changed_at is not None:
        message.status_changed_at.CopyFrom(_ts(row.status_changed_at))
    return message


def snapshot_to_proto(stored: StoredSnapshot) -> feedback_pb2.Snapshot:
    m = stored.manifest
    message = feedback_pb2.Snapshot(
        snapshot_id=m.snapshot_id,
        uri=str(stored.path),
        train_pairs=m.train_pairs,
        test_pairs=m.test_pairs,
        heldout_fraction=m.heldout_fraction,
        excluded_raters={k: "; ".join(v) for k, v in m.excluded_raters.items()},
        excluded=m.excluded,
    )
    if m.last_recorded_at:
        message.last_recorded_at.CopyFrom(_ts(dt.datetime.fromisoformat(m.last_recorded_at)))
    return message


def round_to_proto(row: RlhfRoundRow) -> feedback_pb2.RlhfRound:
    return feedback_pb2.RlhfRound(
        **round_fields(row), started_at=_ts(row.started_at), updated_at=_ts(row.updated_at)
    )


def _caller() -> str:
    principal = current_principal()
    return principal.name if principal is not None else "service"


class FeedbackApi(feedback_pb2_grpc.PreferenceFeedbackServiceServicer):
    """Translates PreferenceFeedbackService RPCs to :class:`FeedbackService` calls."""

    def __init__(
        self,
        service: FeedbackService,
        registry: RewardModelRegistry,
        *,
        max_page_size: int,
        rounds: RlhfRounds | None = None,
        snapshot_dir: Path | None = None,
        default_heldout_fraction: float = 0.1,
        policy: QualityPolicy = QualityPolicy(),
    ) -> None:
        self._service = service
        self._registry = registry
        self._max_page_size = max_page_size
        self._rounds = rounds
        self._snapshot_dir = snapshot_dir
        self._default_heldout = default_heldout_fraction
        self._policy = policy

    async def GetPreferenceStats(
        self, request: feedback_pb2.GetPreferenceStatsRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.GetPreferenceStatsResponse:
        since = timestamp_field(request, "since")
        since = since.replace(tzinfo=None) if since is not None else None  # the store's naive UTC
        stats = await self._service.preference_stats(since, self._policy, batch=request.batch)
        reply = feedback_pb2.GetPreferenceStatsResponse(
            accepted_pairs=stats.accepted,
            accepted_since=stats.accepted_since,
            excluded_raters={k: "; ".join(v) for k, v in stats.excluded_raters.items()},
            batch_comparisons=stats.batch.comparisons,
            batch_accepted=stats.batch.accepted,
            batch_answers=stats.batch.answers,
            batch_raters=stats.batch.raters,
        )
        if stats.last_recorded_at is not None:
            reply.last_recorded_at.CopyFrom(_ts(stats.last_recorded_at))
        return reply

    async def AddComparisons(
        self, request: feedback_pb2.AddComparisonsRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.AddComparisonsResponse:
        require_admin("AddComparisons")
        items = [
            NewComparison(c.key, c.prompt, c.response_1, c.model_1, c.response_2, c.model_2)
            for c in request.comparisons
        ]
        added = await self._service.add_comparisons(request.batch, request.origin, items)
        return feedback_pb2.AddComparisonsResponse(added=added.added, already_present=added.already_present)

    async def ExportSnapshot(
        self, request: feedback_pb2.ExportSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.ExportSnapshotResponse:
        require_admin("ExportSnapshot")
        if self._snapshot_dir is None:
            raise errors.ConflictError("this server has no snapshot folder configured")
        fraction = request.heldout_fraction or self._default_heldout
        if not 0.0 <= fraction < 1.0:
            raise errors.ValidationError("heldout_fraction", "must be in [0, 1)")
        stored = await self._service.export_to_store(
            self._snapshot_dir, heldout_fraction=fraction, policy=self._policy
        )
        return feedback_pb2.ExportSnapshotResponse(snapshot=snapshot_to_proto(stored), created=stored.created)

    async def RecordRlhfRound(
        self, request: feedback_pb2.RecordRlhfRoundRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.RecordRlhfRoundResponse:
        require_admin("RecordRlhfRound")
        rounds = self._require_rounds()
        r = request.round
        model = label(r.reward_model.name, r.reward_model.version) if r.reward_model.name else ""
        row = await rounds.record(
            RoundReport(
                workflow_id=r.workflow_id,
                round=r.round,
                status=r.status,
                step=r.step,
                snapshot_id=r.snapshot_id,
                reward_model=model,
                policy_uri=r.policy_uri,
                reason=r.reason,
                metrics=dict(r.metrics),
            )
        )
        return feedback_pb2.RecordRlhfRoundResponse(round=round_to_proto(row))

    async def ListRlhfRounds(
        self, request: feedback_pb2.ListRlhfRoundsRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.ListRlhfRoundsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        rows, total = await self._require_rounds().list(request.workflow_id, size, offset)
        return feedback_pb2.ListRlhfRoundsResponse(
            rounds=[round_to_proto(r) for r in rows], page=page_info(offset, len(rows), total)
        )

    def _require_rounds(self) -> RlhfRounds:
        if self._rounds is None:
            raise errors.ConflictError("this server keeps no RLHF rounds")
        return self._rounds

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
        rows, total = await self._registry.list(request.name, size, offset)
        return feedback_pb2.ListRewardModelsResponse(
            reward_models=[reward_model_to_proto(r) for r in rows], page=page_info(offset, len(rows), total)
        )

    async def RegisterRewardModel(
        self, request: feedback_pb2.RegisterRewardModelRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.RegisterRewardModelResponse:
        require_admin("RegisterRewardModel")
        if not request.HasField("ref"):
            raise errors.ValidationError("ref", "is required")
        if not request.HasField("heldout"):
            raise errors.ValidationError(
                "heldout", "is required: held-out pairwise accuracy with its interval"
            )
        h = request.heldout
        row = await self._registry.register(
            request.ref.name,
            request.ref.version,
            uri=request.uri,
            snapshot_id=request.snapshot_id,
            backbone=request.backbone,
            heldout=HeldoutAccuracy(h.accuracy, h.ci95_low, h.ci95_high, h.n, h.interval),
            metrics=request.metrics,
            registered_by=_caller(),
        )
        return feedback_pb2.RegisterRewardModelResponse(reward_model=reward_model_to_proto(row))

    async def GetRewardModel(
        self, request: feedback_pb2.GetRewardModelRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.GetRewardModelResponse:
        row = await self._registry.get(request.ref.name, request.ref.version)
        return feedback_pb2.GetRewardModelResponse(reward_model=reward_model_to_proto(row))

    async def SetRewardModelStatus(
        self, request: feedback_pb2.SetRewardModelStatusRequest, context: grpc.aio.ServicerContext
    ) -> feedback_pb2.SetRewardModelStatusResponse:
        require_admin("SetRewardModelStatus")
        if request.status not in STATUS_FROM_PROTO:
            raise errors.ValidationError("status", "must be CANDIDATE, ACTIVE or RETIRED")
        row = await self._registry.set_status(
            request.ref.name, request.ref.version, STATUS_FROM_PROTO[request.status], changed_by=_caller()
        )
        return feedback_pb2.SetRewardModelStatusResponse(reward_model=reward_model_to_proto(row))
