"""The feedback gRPC surface on a real server; preferences reach the real broker via the outbox."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit.db import Database
from forge_kit.events import KafkaPublisher, ensure_topics, topic_for
from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, Principal, make_channel
from forge_kit.outbox import OutboxRelay
from forge_kit.testing import eventkeys
from forge_kit.testing.grpcserver import grpc_test_server
from forge_kit.testing.processes import TansuBroker
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
TOKEN = "test-token"
VIEWER = "viewer-token"


@pytest.fixture
async def server(
    service: FeedbackService, registry: RewardModelRegistry, hh_root: Path
) -> AsyncIterator[GrpcServer]:
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=5, rng_seed=0)
    api = FeedbackApi(service, registry, max_page_size=100)
    async with grpc_test_server(
        feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server,
        api,
        "forge.feedback.v1.PreferenceFeedbackService",
        token=TOKEN,
        service="preference_feedback",
        # A caller that is not an admin (the service token is): may read, not register or change.
        authenticators=[lambda token: Principal("viewer", "team", "research") if token == VIEWER else None],
    ) as started:
        yield started


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[feedback_pb2_grpc.PreferenceFeedbackServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)


async def test_call_without_token_is_unauthenticated(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel).GetNextComparison(
                feedback_pb2.GetNextComparisonRequest(rater_id="alice")
            )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_rate_a_real_comparison_over_grpc(
    stub: feedback_pb2_grpc.PreferenceFeedbackServiceStub,
) -> None:
    item = (await stub.GetNextComparison(feedback_pb2.GetNextComparisonRequest(rater_id="alice"))).comparison
    assert item.id and item.prompt.startswith("Human:") and item.response_a.text and item.response_b.text
    request = feedback_pb2.SubmitPreferenceRequest(
        comparison_id=item.id, rater_id="alice", choice=common_pb2.PREFERENCE_CHOICE_A, confidence=0.9
    )
    first = await stub.SubmitPreference(request)
    assert (await stub.SubmitPreference(request)).preference_id == first.preference_id  # a retry

    request.choice = common_pb2.PREFERENCE_CHOICE_B
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitPreference(request)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitPreference(
            feedback_pb2.SubmitPreferenceRequest(
                comparison_id=item.id, rater_id="alice", choice=common_pb2.PREFERENCE_CHOICE_A, confidence=2
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, "confidence") in tuple(caught.value.trailing_metadata() or ())

    following = (
        await stub.GetNextComparison(feedback_pb2.GetNextComparisonRequest(rater_id="alice"))
    ).comparison
    assert following.id and following.id != item.id


def heldout(accuracy: float = 0.62) -> feedback_pb2.PairwiseAccuracy:
    return feedback_pb2.PairwiseAccuracy(
        accuracy=accuracy, ci95_low=0.5767, ci95_high=0.6614, n=500, interval="wilson"
    )


async def test_reward_models_over_grpc(stub: feedback_pb2_grpc.PreferenceFeedbackServiceStub) -> None:
    registered = await stub.RegisterRewardModel(
        feedback_pb2.RegisterRewardModelRequest(
            ref=common_pb2.ModelRef(name="rm-small"),
            uri="file:///rm/1",
            metrics={"val_loss": 0.6},
            snapshot_id="snap-1",
            backbone="forge-policy-tiny:3",
            heldout=heldout(),
        )
    )
    model = registered.reward_model
    assert model.ref.version == "1" and model.created_at.seconds > 0
    assert model.status == feedback_pb2.REWARD_MODEL_STATUS_CANDIDATE and model.registered_by == "service"
    assert (model.snapshot_id, model.backbone, model.heldout.n, model.heldout.interval) == (
        "snap-1",
        "forge-policy-tiny:3",
        500,
        "wilson",
    )
    listed = await stub.ListRewardModels(feedback_pb2.ListRewardModelsRequest(name="rm-small"))
    assert [m.ref.version for m in listed.reward_models] == ["1"] and listed.page.total_size == 1
    assert dict(listed.reward_models[0].metrics) == {"val_loss": pytest.approx(0.6)}
    activated = await stub.SetRewardModelStatus(
        feedback_pb2.SetRewardModelStatusRequest(
            ref=common_pb2.ModelRef(name="rm-small", version="1"),
            status=feedback_pb2.REWARD_MODEL_STATUS_ACTIVE,
        )
    )
    assert activated.reward_model.status == feedback_pb2.REWARD_MODEL_STATUS_ACTIVE
    assert activated.reward_model.status_changed_at.seconds > 0
    latest = await stub.GetRewardModel(
        feedback_pb2.GetRewardModelRequest(ref=common_pb2.ModelRef(name="rm-small", version="latest"))
    )
    assert latest.reward_model.heldout.accuracy == pytest.approx(0.62)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RegisterRewardModel(feedback_pb2.RegisterRewardModelRequest(uri="file:///rm/2"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith(
        "ref:"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RegisterRewardModel(
            feedback_pb2.RegisterRewardModelRequest(
                ref=common_pb2.ModelRef(name="rm-small"), uri="file:///rm/2", snapshot_id="s", backbone="b"
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata() or ()).get(FIELD_METADATA_KEY) == "heldout"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetRewardModel(
            feedback_pb2.GetRewardModelRequest(ref=common_pb2.ModelRef(name="rm-small", version="9"))
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_only_admins_register_or_change_reward_models(
    server: GrpcServer, stub: feedback_pb2_grpc.PreferenceFeedbackServiceStub
) -> None:
    request = feedback_pb2.RegisterRewardModelRequest(
        ref=common_pb2.ModelRef(name="rm"), uri="file:///rm", snapshot_id="s", backbone="b", heldout=heldout()
    )
    await stub.RegisterRewardModel(request)
    async with make_channel(f"127.0.0.1:{server.port}", token=VIEWER) as channel:
        viewer = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        assert len((await viewer.ListRewardModels(feedback_pb2.ListRewardModelsRequest())).reward_models) == 1
        for call in (
            viewer.RegisterRewardModel(request),
            viewer.SetRewardModelStatus(
                feedback_pb2.SetRewardModelStatusRequest(
                    ref=common_pb2.ModelRef(name="rm", version="1"),
                    status=feedback_pb2.REWARD_MODEL_STATUS_ACTIVE,
                )
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    listed = await stub.ListRewardModels(feedback_pb2.ListRewardModelsRequest())
    assert [(m.ref.version, m.status) for m in listed.reward_models] == [
        ("1", feedback_pb2.REWARD_MODEL_STATUS_CANDIDATE)
    ]


async def test_preference_recorded_reaches_kafka(
    kafka_broker: TansuBroker, service: FeedbackService, db: Database, hh_root: Path
) -> None:
    topic = topic_for(events_pb2.PreferenceRecorded())
    await ensure_topics(kafka_broker.bootstrap, [topic])
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=1, rng_seed=0)
    item = await service.next_comparison("alice")
    assert item is not None
    pref = await service.submit_preference(item.id, "alice", common_pb2.PREFERENCE_CHOICE_B, 0.6, "")
    publisher = KafkaPublisher(kafka_broker.bootstrap)
    try:
        assert (
            await OutboxRelay(db, publisher, signer=eventkeys.signer("preference_feedback")).relay_once() == 1
        )
    finally:
        await publisher.close()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka_broker.bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        found = None
        async with asyncio.timeout(20):
            while found is None:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        event = events_pb2.PreferenceRecorded.FromString(record.value)
                        if event.preference_id == pref.id:
                            found = event
    finally:
        await consumer.stop()
    assert (found.comparison_id, found.rater_id, found.choice) == (
        item.id,
        "alice",
        common_pb2.PREFERENCE_CHOICE_B,
    )
    assert (found.chosen_text, found.rejected_text) == (item.response_b_text, item.response_a_text)
