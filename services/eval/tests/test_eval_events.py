"""A promotion reaches the real broker through the outbox relay, with every field intact."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer
from forge.events.v1 import events_pb2

from forge_eval.registry import ModelRegistry
from forge_kit.db import Database
from forge_kit.events import HEADER_ID, HEADER_TYPE, KafkaPublisher, ensure_topics, topic_for
from forge_kit.outbox import OutboxRelay
from forge_kit.testing import eventkeys
from forge_kit.testing.processes import TansuBroker

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]


async def test_model_promoted_is_relayed_to_kafka(
    kafka_broker: TansuBroker, registry: ModelRegistry, db: Database
) -> None:
    topic = topic_for(events_pb2.ModelPromoted())
    await ensure_topics(kafka_broker.bootstrap, [topic, topic_for(events_pb2.EvalCompleted())])
    await registry.register_model("tiny", "1", "file:///ckpt/1", {})
    await registry.register_model("tiny", "2", "file:///ckpt/2", {})
    await registry.promote_model(
        "tiny", "1", "production", traffic_percent=0, reason="first", force=True, actor="alice"
    )
    await registry.promote_model(
        "tiny", "2", "canary", traffic_percent=10, reason="try it", force=True, actor="alice"
    )

    publisher = KafkaPublisher(kafka_broker.bootstrap)
    try:
        assert await OutboxRelay(db, publisher, signer=eventkeys.signer("eval")).relay_once() == 2
    finally:
        await publisher.close()

    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=kafka_broker.bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        received: dict[str, tuple[events_pb2.ModelPromoted, dict[str, bytes], bytes | None]] = {}
        async with asyncio.timeout(20):
            while len(received) < 2:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        event = events_pb2.ModelPromoted.FromString(record.value)
                        received[event.stage] = (event, dict(record.headers), record.key)
    finally:
        await consumer.stop()

    canary, headers, key = received["canary"]
    assert (canary.model.name, canary.model.version, canary.traffic_percent, canary.reason) == (
        "tiny",
        "2",
        10,
        "try it",
    )
    assert not canary.HasField("previous") and not canary.is_rollback
    assert key == b"canary" and headers[HEADER_TYPE] == b"forge.events.v1.ModelPromoted"
    assert headers[HEADER_ID].decode() == canary.meta.event_id and canary.meta.producer == "eval"
    production = received["production"][0]
    assert (production.model.version, production.traffic_percent, production.reason) == ("1", 100, "first")
