"""What the guarded canary's analysis reads from the gateway: per model version and split, every
request's outcome (a crashed canary replica counted as ``unavailable``, not as missing traffic),
TTFT and inter-token latency histograms, empty answers; and the canary's end by a rollback event."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest

from forge_experiments.canary import parse_metrics
from forge_inference_gateway.service import InferenceGateway
from forge_kit.db import Database
from forge_kit.testing import eventually

from .conftest import apply_promotions as apply
from .conftest import model_promoted

promoted = functools.partial(model_promoted, "tiny")


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


@pytest.mark.asyncio
async def test_shadow_mode_mirrors_without_serving_and_keeps_the_pairs(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    admin_headers: dict[str, str],
    db: Database,
) -> None:
    stable = await replicas(version="41")
    candidate = await replicas(version="42")
    gateway = await make_gateway([stable.url, candidate.url])
    await gateway.pool.refresh()
    await apply(gateway, db, promoted("41", "production"))

    def shadow_count() -> float:
        labels = {"model": "tiny:42", "split": "shadow", "status": "200"}
        return REGISTRY.get_sample_value("forge_gateway_upstream_requests_total", labels) or 0.0

    before = shadow_count()
    async with client_for(gateway) as client:
        for bad, param in (({"model": {"name": "tiny", "version": "42"}, "percent": 101}, "percent"),):
            reply = await client.put("/admin/v1/aliases/forge-chat/shadow", json=bad, headers=admin_headers)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param
        reply = await client.put(
            "/admin/v1/aliases/forge-chat/shadow",
            json={"model": {"name": "tiny", "version": "42"}, "percent": 100},
            headers=admin_headers,
        )
        assert reply.status_code == 200 and reply.json()["shadow"]["percent"] == 100
        for i in range(4):
            reply = await client.post(
                "/v1/completions",
                json={"model": "forge-chat", "prompt": f"hi {i}", "max_tokens": 2, "user": f"u{i}"},
            )
            assert reply.status_code == 200 and reply.headers["x-forge-model"] == "tiny:41"
        body = {"model": "forge-chat", "prompt": "stream", "max_tokens": 2, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as streamed:
            await streamed.aread()  # streams are not mirrored

        async def mirrored() -> bool:
            return shadow_count() - before >= 4 and len(await gateway.shadows.pairs("forge-chat", 0, 50)) >= 4

        await eventually(mirrored, what="the 4 non-streamed requests mirrored to the shadow and stored")
        reply = await client.get("/admin/v1/shadow/pairs?alias=forge-chat&limit=2", headers=admin_headers)
        page = reply.json()
        assert reply.status_code == 200 and len(page["pairs"]) == 2
        rest = await client.get(
            f"/admin/v1/shadow/pairs?alias=forge-chat&after_id={page['next_after_id']}", headers=admin_headers
        )
        pairs = page["pairs"] + rest.json()["pairs"]
        assert sorted(p["request"]["prompt"] for p in pairs) == [f"hi {i}" for i in range(4)]
        assert all(p["production"]["model"] == "tiny:41" and p["shadow"]["model"] == "tiny:42" for p in pairs)
        assert all(p["shadow"]["status"] == "200" and p["shadow"]["answer"] for p in pairs)
        assert shadow_count() - before == 4
        assert [b["model"] for b in candidate.bodies] == ["tiny:42"] * 4
        reply = await client.get("/admin/v1/shadow/pairs?limit=0", headers=admin_headers)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit"
        for after_id in (-1, 2**63):  # beyond the 64-bit id column: a clear 400, not a 500
            reply = await client.get(f"/admin/v1/shadow/pairs?after_id={after_id}", headers=admin_headers)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "after_id"
        reply = await client.delete("/admin/v1/aliases/forge-chat/shadow", headers=admin_headers)
        assert reply.status_code == 200 and reply.json()["shadow"] is None
