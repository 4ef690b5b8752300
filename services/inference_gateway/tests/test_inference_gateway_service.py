"""Tenants and keys, admission, aliases from ModelPromoted events: domain logic, no network."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from aiokafka import ConsumerRecord
from forge.events.v1 import events_pb2

from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.store import TenantRow
from forge_inference_gateway.tenants.registry import hash_api_key
from forge_kit import errors
from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.events import topic_for
from forge_kit.modelref import ModelRef
from forge_kit.testing import eventkeys


async def test_keys_are_stored_as_sha256_only(gateway: InferenceGateway, db: Database) -> None:
    tenant, key = await gateway.tenants.create_tenant("search-app", "batch", rpm_limit=30)
    async with db.session() as session:
        row = await session.get(TenantRow, tenant.id)
    assert row is not None and row.key_hash == hashlib.sha256(key.encode()).hexdigest() == hash_api_key(key)
    assert key not in repr(row.__dict__)
    assert (await gateway.tenants.authenticate(key)).name == "search-app"


async def test_authentication_rejects_missing_and_wrong_keys(gateway: InferenceGateway, api_key: str) -> None:
    assert (await gateway.tenants.authenticate(api_key)).name == "default"
    for key in ("", "not-a-key"):
        with pytest.raises(errors.UnauthenticatedError):
            await gateway.tenants.authenticate(key)


async def test_service_token_acts_as_default_tenant(gateway: InferenceGateway) -> None:
    assert (await gateway.tenants.authenticate("admin-token")).name == "default"


async def test_bootstrap_is_idempotent_and_rekeys(
    gateway: InferenceGateway, api_key: str, db: Database
) -> None:
    await gateway.tenants.bootstrap(api_key)
    await gateway.tenants.bootstrap("rotated-key")
    async with db.session() as session:
        count = await session.scalar(sa.select(sa.func.count()).select_from(TenantRow))
    assert count == 1
    assert (await gateway.tenants.authenticate("rotated-key")).name == "default"
    with pytest.raises(errors.UnauthenticatedError):
        await gateway.tenants.authenticate(api_key)


@pytest.mark.parametrize(
    ("name", "priority_class", "rpm", "field"),
    [
        ("Bad Name", "interactive", None, "name"),
        ("ok", "urgent", None, "priority_class"),
        ("ok", "batch", 0, "rpm_limit"),
    ],
)
async def test_create_tenant_validates(
    gateway: InferenceGateway, name: str, priority_class: str, rpm: int | None, field: str
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await gateway.tenants.create_tenant(name, priority_class, rpm)
    assert caught.value.field == field


async def test_duplicate_tenant_is_refused(gateway: InferenceGateway) -> None:
    with pytest.raises(errors.AlreadyExistsError):
        await gateway.tenants.create_tenant("default")


async def test_rate_limit_refuses_with_retry_after_and_refills(
    gateway: InferenceGateway, api_key: str, clock: Any
) -> None:
    tenant = await gateway.tenants.authenticate(api_key)  # 5 requests per minute
    for _ in range(5):
        await gateway.tenants.admit(tenant)
    with pytest.raises(errors.OverloadedError) as caught:
        await gateway.tenants.admit(tenant)
    assert caught.value.retry_after_s == pytest.approx(12.0)  # one request every 60/5 s
    clock.now += 12.0
    await gateway.tenants.admit(tenant)


async def test_production_promotion_sets_forge_chat(
    gateway: InferenceGateway, db: Database, promoted: Callable[..., events_pb2.ModelPromoted]
) -> None:
    async with db.session() as session:
        await gateway.aliases.apply_model_promoted(promoted("tiny-llama", "3"), session)
    assert await gateway.aliases.resolve_model("forge-chat") == (
        ModelRef("tiny-llama", "3"),
        (await gateway.aliases.list_aliases())[0],
    )
    async with db.session() as session:
        await gateway.aliases.apply_model_promoted(promoted("tiny-llama", "4"), session)
        await gateway.aliases.apply_model_promoted(promoted("tiny-llama", "5", stage="canary"), session)
    aliases = {a.alias: (a.target, a.stage) for a in await gateway.aliases.list_aliases()}
    assert aliases == {
        "forge-chat": ("tiny-llama:4", "production"),
        "production": ("tiny-llama:4", "production"),
        "canary": ("tiny-llama:5", "canary"),
    }
    assert await gateway.aliases.resolve_model("tiny-llama") == (ModelRef("tiny-llama"), None)
    # A pinned reference is a model version, never an alias; what is not a reference is refused.
    assert await gateway.aliases.resolve_model("forge-chat:4") == (ModelRef("forge-chat", "4"), None)
    for bad in ("tiny llama", "a/b", "x:", "x\r\nset-cookie: 1"):
        with pytest.raises(errors.ValidationError, match="invalid model") as caught:
            await gateway.aliases.resolve_model(bad)
        assert caught.value.field == "model"


async def test_promotion_without_stage_is_rejected(
    gateway: InferenceGateway, db: Database, promoted: Callable[..., events_pb2.ModelPromoted]
) -> None:
    with pytest.raises(errors.ValidationError):
        async with db.session() as session:
            await gateway.aliases.apply_model_promoted(promoted("tiny", stage=" "), session)


async def test_consumer_applies_a_promotion_once(
    gateway: InferenceGateway, db: Database, promoted: Callable[..., events_pb2.ModelPromoted]
) -> None:
    event = promoted("tiny", "1")
    consumer = EventConsumer(
        db,
        bootstrap="unused:0",
        group_id="inference_gateway",
        topics=[topic_for(event)],
        handler=gateway.aliases.apply_model_promoted,
        verifier=eventkeys.verifier(),
    )
    headers = eventkeys.headers_for(event)
    record = ConsumerRecord(
        topic=topic_for(event),
        partition=0,
        offset=0,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=event.SerializeToString(),
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0,
        headers=headers,
    )
    assert await consumer.handle(record) is True
    # A later promotion, then the first event redelivered: the redelivery must not roll back.
    async with db.session() as session:
        await gateway.aliases.apply_model_promoted(promoted("tiny", "2"), session)
    assert await consumer.handle(record) is False
    assert (await gateway.aliases.resolve_model("forge-chat"))[0] == ModelRef("tiny", "2")


async def test_reads_are_loaded_once_for_concurrent_requests_and_never_after_a_change() -> None:
    import asyncio

    from forge_inference_gateway.caching.read_through import ReadThrough

    now = [0.0]
    cache: ReadThrough[str, int] = ReadThrough(ttl_s=1.0, clock=lambda: now[0])
    loads = []
    gate = asyncio.Event()

    async def load() -> int:
        loads.append(1)
        await gate.wait()
        return len(loads)

    readers = [asyncio.create_task(cache.get("k", load)) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*readers) == [1] * 20 and len(loads) == 1
    assert await cache.get("k", load) == 1  # fresh
    now[0] = 1.5
    assert await cache.get("k", load) == 1  # expired: answered stale while one read refreshes it
    await asyncio.sleep(0.01)
    assert len(loads) == 2 and await cache.get("k", load) == 2
    # A change (clear) while a read is in flight: that read's result is not kept.
    gate.clear()
    cache.clear()
    stale = asyncio.create_task(cache.get("k", load))
    await asyncio.sleep(0)
    cache.clear()
    gate.set()
    assert await stale == 3
    assert await cache.get("k", load) == 4
    # A refresh that fails drops the entry instead of serving it on.
    now[0] = 10.0

    async def gone() -> int:
        raise KeyError("k")

    assert await cache.get("k", gone) == 4
    await asyncio.sleep(0.01)
    with pytest.raises(KeyError):
        await cache.get("k", gone)
