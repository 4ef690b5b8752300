"""Canary traffic on an alias: set by ModelPromoted events or the admin API, split by a sticky hash,
rolled back at once, and counted per model version."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY

from forge_inference_gateway.routing.router import GenerationRequest
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.tenants.registry import Tenant
from forge_kit import errors
from forge_kit.db import Database

from .conftest import apply_promotions as apply
from .conftest import model_promoted as promoted


async def targets(gateway: InferenceGateway, tenant: Tenant, users: range) -> list[str]:
    body = {"model": "forge-chat", "prompt": "hi"}
    return [
        (
            await gateway.router.route(
                tenant, "/v1/completions", GenerationRequest.parse({**body, "user": f"u{i}"})
            )
        ).target
        for i in users
    ]


async def test_canary_event_splits_the_production_aliases_stickily_until_rolled_back(
    gateway: InferenceGateway, db: Database, api_key: str
) -> None:
    tenant = await gateway.tenants.authenticate(api_key)
    await apply(gateway, db, promoted("tiny", "3", "production"), promoted("tiny", "4", "canary", traffic=10))
    aliases = {a.alias: a for a in await gateway.aliases.list_aliases()}
    assert (aliases["forge-chat"].canary_target, aliases["forge-chat"].canary_weight) == ("tiny:4", 10)
    assert (aliases["canary"].target, aliases["canary"].canary_weight) == ("tiny:4", 0)
    first = await targets(gateway, tenant, range(1000))
    # The tenant id is random per run, so the count is Binomial(1000, 0.1): 48-152 is 5.5 sigma.
    assert 48 <= first.count("tiny:4") <= 152 and set(first) == {"tiny:3", "tiny:4"}
    assert await targets(gateway, tenant, range(1000)) == first  # the same user, the same version
    # Without a user the session header keeps it sticky; without either, the request itself does.
    routed = [
        await gateway.router.route(
            tenant,
            "/v1/completions",
            GenerationRequest.parse({"model": "production", "prompt": "p"}),
            f"s{i}",
        )
        for i in range(200)
    ]
    assert {r.split for r in routed} == {"stable", "canary"}
    assert all(r.split == ("canary" if r.target == "tiny:4" else "stable") for r in routed)
    # Rollback: weight 0 at once, everything stable.
    await apply(gateway, db, promoted("tiny", "4", "canary", traffic=10, rollback=True))
    assert set(await targets(gateway, tenant, range(300))) == {"tiny:3"}
    # A new canary, then its promotion to production ends the split.
    await apply(gateway, db, promoted("tiny", "5", "canary", traffic=50))
    assert set(await targets(gateway, tenant, range(100))) == {"tiny:3", "tiny:5"}
    await apply(gateway, db, promoted("tiny", "5", "production"))
    assert set(await targets(gateway, tenant, range(100))) == {"tiny:5"}
    assert (await gateway.aliases.alias_named("forge-chat")).canary_weight == 0  # type: ignore[union-attr]


async def test_events_of_different_stages_arriving_out_of_order_do_not_undo_a_later_promotion(
    gateway: InferenceGateway, db: Database, api_key: str
) -> None:
    """The registry keys its events by stage, so a canary event may arrive after later production
    events: the aliases end as the registry's order of changes says, not as they arrived."""
    tenant = await gateway.tenants.authenticate(api_key)
    canary_a, production_a, production_c = (
        promoted("run-a", "1", "canary", traffic=10),
        promoted("run-a", "1", "production"),
        promoted("run-c", "1", "production"),
    )
    for seconds, event in enumerate((canary_a, production_a, production_c)):
        event.meta.occurred_at.FromSeconds(1_700_000_000 + seconds)
    # In the registry's order: no split is left (run-a's canary ended when it became production).
    await apply(gateway, db, production_a, production_c, canary_a)
    alias = await gateway.aliases.alias_named("forge-chat")
    assert alias is not None and (alias.target, alias.canary_weight) == ("run-c:1", 0)
    assert set(await targets(gateway, tenant, range(200))) == {"run-c:1"}
    # A stale production event (redelivered late) does not move production back either.
    await apply(gateway, db, production_a)
    assert set(await targets(gateway, tenant, range(50))) == {"run-c:1"}
    # A canary promoted after the current stable splits it, and a newer production ends the split.
    canary_d = promoted("run-d", "1", "canary", traffic=50)
    canary_d.meta.occurred_at.FromSeconds(1_700_000_010)
    await apply(gateway, db, canary_d)
    assert set(await targets(gateway, tenant, range(100))) == {"run-c:1", "run-d:1"}
    production_e = promoted("run-e", "1", "production")
    production_e.meta.occurred_at.FromSeconds(1_700_000_020)
    await apply(gateway, db, production_e)
    assert set(await targets(gateway, tenant, range(100))) == {"run-e:1"}


async def test_an_alias_target_unfit_for_a_header_is_never_stored(
    gateway: InferenceGateway, db: Database
) -> None:
    """The alias's target is echoed in ``x-forge-model``: a promotion event or an admin canary
    naming a model with CR/LF, NUL or a megabyte of characters is refused, the alias unchanged."""
    await apply(gateway, db, promoted("tiny", "3", "production"))
    for name, version in (("tiny\r\nx-injected: 1", "4"), ("tiny", "4\x00"), ("x" * (1 << 20), "")):
        with pytest.raises(errors.ValidationError):
            await apply(gateway, db, promoted(name, version, "canary", traffic=10))
        with pytest.raises(errors.ValidationError):
            await gateway.aliases.set_canary("forge-chat", name, version, 10)
    alias = await gateway.aliases.alias_named("forge-chat")
    assert alias is not None and (alias.target, alias.canary_weight) == ("tiny:3", 0)


async def test_canary_over_real_replicas_via_the_admin_api_with_per_version_metrics(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    admin_headers: dict[str, str],
    db: Database,
) -> None:
    stable, canary = await replicas(version="3"), await replicas(version="4")
    gateway = await make_gateway([stable.url, canary.url])
    await gateway.pool.refresh()
    await apply(gateway, db, promoted("tiny", "3", "production"))

    def served(version: str) -> float:
        labels = {
            "model": f"tiny:{version}",
            "split": "canary" if version == "4" else "stable",
            "status": "200",
        }
        return REGISTRY.get_sample_value("forge_gateway_upstream_requests_total", labels) or 0.0

    before = served("3"), served("4")
    async with client_for(gateway) as client:
        reply = await client.put(
            "/admin/v1/aliases/forge-chat/canary",
            json={"model": {"name": "tiny", "version": "4"}, "weight": 30},
            headers=admin_headers,
        )
        assert reply.status_code == 200 and reply.json()["canary"]["weight"] == 30
        seen = []
        for i in range(40):
            reply = await client.post(
                "/v1/completions",
                json={"model": "forge-chat", "prompt": "hi", "max_tokens": 1, "user": f"u{i}"},
            )
            assert reply.status_code == 200
            seen.append(reply.headers["x-forge-model"])
        assert [b["model"] for b in canary.bodies] == ["tiny:4"] * seen.count("tiny:4") and canary.bodies
        assert [b["model"] for b in stable.bodies] == ["tiny:3"] * seen.count("tiny:3") and stable.bodies
        assert (served("3") - before[0], served("4") - before[1]) == (
            seen.count("tiny:3"),
            seen.count("tiny:4"),
        )
        models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert models["forge-chat"]["canary"] == {"model": "tiny:4", "weight": 30}
        # Instant rollback.
        reply = await client.delete("/admin/v1/aliases/forge-chat/canary", headers=admin_headers)
        assert reply.status_code == 200 and reply.json()["canary"]["weight"] == 0
        for i in range(10):
            reply = await client.post(
                "/v1/completions",
                json={"model": "forge-chat", "prompt": "hi", "max_tokens": 1, "user": f"u{i}"},
            )
            assert reply.headers["x-forge-model"] == "tiny:3"
        # Bad input names the field; an unknown alias is a 404.
        reply = await client.put(
            "/admin/v1/aliases/forge-chat/canary",
            json={"model": {"name": "tiny"}, "weight": 101},
            headers=admin_headers,
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "weight"
        reply = await client.put(
            "/admin/v1/aliases/nope/canary",
            json={"model": {"name": "tiny"}, "weight": 5},
            headers=admin_headers,
        )
        assert reply.status_code == 404
