"""Activities of the RLHF workflow: calls to the preference-feedback service over gRPC, and
reading the small JSON summaries its jobs write to the shared object store.

Each returns plain dataclasses (Temporal serialises them as JSON). Failures follow
:func:`forge_orchestrator.activities.failed`: permanent gRPC statuses are non-retryable.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

import grpc
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit.grpckit import LazyChannel
from forge_kit.modelref import ModelRef
from forge_kit.objectstore import ObjectStore
from forge_orchestrator.activities import failed

STATUSES = {
    "candidate": feedback_pb2.REWARD_MODEL_STATUS_CANDIDATE,
    "active": feedback_pb2.REWARD_MODEL_STATUS_ACTIVE,
    "retired": feedback_pb2.REWARD_MODEL_STATUS_RETIRED,
}


@dataclass
class PairStats:
    """Accepted pairs (raters not flagged, A or B answers): in all, and since the watermark."""

    accepted: int
    accepted_since: int
    last_recorded_at: str = ""
    """ISO time of the newest accepted pair; empty when there is none."""
    excluded_raters: dict[str, str] = field(default_factory=dict)


@dataclass
class BatchStats:
    """Answers to an online round's comparisons (one batch of the feedback service)."""

    comparisons: int
    accepted: int
    answers: int
    raters: int


@dataclass
class SnapshotInfo:
    snapshot_id: str
    uri: str
    """Folder with ``train.jsonl.gz``, ``test.jsonl.gz`` and ``manifest.json``."""
    train_pairs: int
    test_pairs: int
    last_recorded_at: str = ""
    excluded_raters: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, int] = field(default_factory=dict)
    created: bool = True


@dataclass
class RegisterRewardModelInput:
    name: str
    version: str
    uri: str
    snapshot_id: str
    backbone: str
    accuracy: float
    ci95_low: float
    ci95_high: float
    n: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RewardModelStatusInput:
    name: str
    version: str
    status: str
    """``candidate``, ``active`` or ``retired``."""


@dataclass
class RoundReportInput:
    """One RLHF round's record in the feedback service (its admin page); see RecordRlhfRound."""

    workflow_id: str
    round: int
    status: str
    step: str = ""
    snapshot_id: str = ""
    reward_model: str = ""
    """``name:version``."""
    policy_uri: str = ""
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def _iso(stamp: Any) -> str:
    return stamp.ToDatetime().replace(tzinfo=dt.UTC).isoformat() if stamp.seconds or stamp.nanos else ""


class RlhfActivities:
    """Feedback-service calls and object-store reads for the RLHF workflow. One per worker; the
    channel opens on first use, in the worker's event loop."""

    def __init__(self, feedback_target: str, token: str, *, rpc_timeout_s: float = 60.0) -> None:
        self._rpc_timeout_s = rpc_timeout_s
        self._channel = LazyChannel(feedback_target, token)

    def _stub(self) -> feedback_pb2_grpc.PreferenceFeedbackServiceAsyncStub:
        return feedback_pb2_grpc.PreferenceFeedbackServiceStub(self._channel.get())

    async def close(self) -> None:
        await self._channel.close()

    @activity.defn(name="rlhf_preference_stats")
    async def preference_stats(self, since: str) -> PairStats:
        """Accepted pairs in all and recorded after ``since`` (ISO; empty: all count as new)."""
        request = feedback_pb2.GetPreferenceStatsRequest()
        if since:
            request.since.FromDatetime(dt.datetime.fromisoformat(since))
        try:
            reply = await self._stub().GetPreferenceStats(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("GetPreferenceStats", exc) from exc
        return PairStats(
            accepted=reply.accepted_pairs,
            accepted_since=reply.accepted_since if since else reply.accepted_pairs,
            last_recorded_at=_iso(reply.last_recorded_at),
            excluded_raters=dict(reply.excluded_raters),
        )

    @activity.defn(name="rlhf_batch_stats")
    async def batch_stats(self, batch: str) -> BatchStats:
        """Comparisons queued under ``batch``, their accepted pairs, answers and raters."""
        request = feedback_pb2.GetPreferenceStatsRequest(batch=batch)
        try:
            reply = await self._stub().GetPreferenceStats(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("GetPreferenceStats", exc) from exc
        return BatchStats(
            comparisons=reply.batch_comparisons,
            accepted=reply.batch_accepted,
            answers=reply.batch_answers,
            raters=reply.batch_raters,
        )

    @activity.defn(name="rlhf_export_snapshot")
    async def export_snapshot(self, heldout_fraction: float) -> SnapshotInfo:
        request = feedback_pb2.ExportSnapshotRequest(heldout_fraction=heldout_fraction)
        try:
            reply = await self._stub().ExportSnapshot(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("ExportSnapshot", exc) from exc
        s = reply.snapshot
        return SnapshotInfo(
            snapshot_id=s.snapshot_id,
            uri=s.uri,
            train_pairs=s.train_pairs,
            test_pairs=s.test_pairs,
            last_recorded_at=_iso(s.last_recorded_at),
            excluded_raters=dict(s.excluded_raters),
            excluded=dict(s.excluded),
            created=reply.created,
        )

    @activity.defn(name="rlhf_register_reward_model")
    async def register_reward_model(self, params: RegisterRewardModelInput) -> str:
        """Register the version (idempotent: a retry finds it registered); returns ``name:version``."""
        request = feedback_pb2.RegisterRewardModelRequest(
            ref=common_pb2.ModelRef(name=params.name, version=params.version),
            uri=params.uri,
            snapshot_id=params.snapshot_id,
            backbone=params.backbone,
            metrics=params.metrics,
            heldout=feedback_pb2.PairwiseAccuracy(
                accuracy=params.accuracy,
                ci95_low=params.ci95_low,
                ci95_high=params.ci95_high,
                n=params.n,
                interval="wilson",
            ),
        )
        try:
            await self._stub().RegisterRewardModel(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise failed("RegisterRewardModel", exc) from exc
        return str(ModelRef(params.name, params.version))

    @activity.defn(name="rlhf_set_reward_model_status")
    async def set_reward_model_status(self, params: RewardModelStatusInput) -> str:
        request = feedback_pb2.SetRewardModelStatusRequest(
            ref=common_pb2.ModelRef(name=params.name, version=params.version), status=STATUSES[params.status]
        )
        try:
            reply = await self._stub().SetRewardModelStatus(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("SetRewardModelStatus", exc) from exc
        return feedback_pb2.RewardModelStatus.Name(reply.reward_model.status)

    @activity.defn(name="rlhf_record_round")
    async def record_round(self, params: RoundReportInput) -> None:
        try:
            reward_model = ModelRef.parse_optional(params.reward_model)
        except ValueError as exc:
            raise ApplicationError(f"reward model: {exc}", non_retryable=True) from None
        request = feedback_pb2.RecordRlhfRoundRequest(
            round=feedback_pb2.RlhfRound(
                workflow_id=params.workflow_id,
                round=params.round,
                status=params.status,
                step=params.step,
                snapshot_id=params.snapshot_id,
                reward_model=(
                    common_pb2.ModelRef(name=reward_model.name, version=reward_model.version)
                    if reward_model is not None
                    else None
                ),
                policy_uri=params.policy_uri,
                reason=params.reason,
                metrics=params.metrics,
            )
        )
        try:
            await self._stub().RecordRlhfRound(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("RecordRlhfRound", exc) from exc

    @activity.defn(name="rlhf_read_json")
    async def read_json(self, uri: str) -> dict[str, Any]:
        """A JSON object a job wrote (a summary), by path or object-store URL."""
        base, _, name = uri.rpartition("/")
        store = ObjectStore(base or ".")
        try:
            data = json.loads(await asyncio.to_thread(store.get_bytes, name))
        except FileNotFoundError:
            raise ApplicationError(
                f"{uri} does not exist", type="MissingSummary", non_retryable=True
            ) from None
        except json.JSONDecodeError as exc:
            raise ApplicationError(
                f"{uri} is not JSON: {exc.msg}", type="BadSummary", non_retryable=True
            ) from None
        if not isinstance(data, dict):
            raise ApplicationError(f"{uri} is not a JSON object", type="BadSummary", non_retryable=True)
        return data
