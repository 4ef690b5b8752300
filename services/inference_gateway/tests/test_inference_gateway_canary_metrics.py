"""What the guarded canary's analysis reads from the gateway: per model version and split, every
request's outcome (a crashed canary replica counted as ``unavailable``, not as missing traffic),
TTFT and inter-token latency histograms, empty answers; and the canary's end by a rollback event."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from prometheus_client import REGISTRY, generate_latest

from forge_inference_gateway.service import InferenceGateway
from forge_kit.canary import parse_metrics
from forge_kit.db import Database
from forge_kit.events import new_meta


def promoted(
    version: str, stage: str, traffic: int = 100, rollback: bool = False
) -> events_pb2.ModelPromoted:
    return events_pb2.ModelPromoted(
        meta=new_meta("eval"),
        model=common_pb2.ModelRef(name="tiny", version=version),
        stage=stage,
        traffic_percent=traffic,
        is_rollback=rollback,
        reason="test",
    )


async def apply(gateway: InferenceGateway, db: Database, *events: events_pb2.ModelPromoted) -> None:
    async with db.session() as session:
        for event in events:
            await gateway.aliases.apply_model_promoted(event, session)


@pytest.mark.asyncio
async def test_split_metrics_count_streams_latency_and_a_crashed_canary(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    db: Database,
) -> None:
    stable = await replicas(version="31", token_delay_s=0.002)
    canary = await replicas(version="32", token_delay_s=0.002)
    gateway = await make_gateway([stable.url, canary.url])
    await gateway.pool.refresh()
    await apply(gateway, db, promoted("31", "production"), promoted("32", "canary", traffic=50))
    series = [("tiny:31", "stable"), ("tiny:32", "canary")]
    before = parse_metrics(generate_latest(REGISTRY).decode(), series)
    seen: list[str] = []
    async with client_for(gateway) as client:
        for i in range(30):
            body = {"model": "forge-chat", "prompt": "hi", "max_tokens": 4, "stream": True, "user": f"u{i}"}
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                await reply.aread()
                seen.append(reply.headers["x-forge-model"])
        canary_users = [f"u{i}" for i, model in enumerate(seen) if model == "tiny:32"]
        assert canary_users and len(canary_users) < 30
        # The canary's replica crashes: its users' requests fail, and count as its failures.
        await canary.stop()
        await gateway.pool.refresh()
        for user in canary_users[:3]:
            reply = await client.post(
                "/v1/completions", json={"model": "forge-chat", "prompt": "hi", "max_tokens": 2, "user": user}
            )
            assert reply.status_code in (404, 502, 503)
    after = parse_metrics(generate_latest(REGISTRY).decode(), series)
    prod = after[("tiny:31", "stable")].minus(before[("tiny:31", "stable")])
    can = after[("tiny:32", "canary")].minus(before[("tiny:32", "canary")])
    assert prod.requests().n == 30 - len(canary_users) and prod.requests().k == 0
    assert can.requests().n == len(canary_users) + 3 and can.requests().k == 3
    assert can.statuses.get("unavailable", 0) + can.statuses.get("503", 0) >= 3
    assert prod.ttft["+Inf"] == 30 - len(canary_users) and prod.itl["+Inf"] == 30 - len(canary_users)
    assert can.empty == 0 and prod.empty == 0


@pytest.mark.asyncio
async def test_a_guarded_canary_rollback_ends_the_split_and_the_canary_alias(
    gateway: InferenceGateway, db: Database
) -> None:
    await apply(gateway, db, promoted("3", "production"), promoted("4", "canary", traffic=10))
    await apply(gateway, db, promoted("4", "canary", traffic=0, rollback=True))
    aliases = {a.alias: a for a in await gateway.aliases.list_aliases()}
    assert "canary" not in aliases
    assert (aliases["forge-chat"].target, aliases["forge-chat"].canary_weight) == ("tiny:3", 0)
