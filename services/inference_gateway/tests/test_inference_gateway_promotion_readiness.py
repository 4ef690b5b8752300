"""A promotion made while the new version's replicas still start (``forge eval promote``, a
rollback): the alias keeps sending its traffic to the version it named before until a replica of
the new one joins the pool, then moves at once; and a canary promoted to production leaves no
split and no ``canary`` alias behind."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from forge_inference_gateway.routing.router import GenerationRequest
from forge_inference_gateway.service import InferenceGateway
from forge_kit.db import Database
from forge_kit.modelref import ModelRef

from .conftest import apply_promotions as apply
from .conftest import model_promoted

pytestmark = pytest.mark.timeout(120)


promoted = functools.partial(model_promoted, "tiny")


async def served_by(client: Any, n: int = 6) -> set[str]:
    """The versions that answered ``n`` requests for ``forge-chat`` (every one must succeed)."""
    seen = set()
    for i in range(n):
        reply = await client.post(
            "/v1/completions",
            json={"model": "forge-chat", "prompt": "hi", "max_tokens": 1, "user": f"u{i}"},
        )
        assert reply.status_code == 200, reply.text
        seen.add(reply.headers["x-forge-model"])
    return seen


async def test_the_alias_moves_when_a_replica_of_the_new_version_is_ready_not_when_promoted(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    admin_headers: dict[str, str],
    db: Database,
) -> None:
    # Replicas join as a deployment adds them: through the admin API, none configured.
    gateway = await make_gateway([])
    v3 = await replicas(version="3")
    async with client_for(gateway) as client:

        async def join(url: str) -> None:
            reply = await client.post("/admin/v1/replicas", json={"url": url}, headers=admin_headers)
            assert reply.status_code == 201, reply.text
            await gateway.pool.refresh()

        async def leave(url: str) -> None:
            reply = await client.request(
                "DELETE", "/admin/v1/replicas", params={"url": url}, headers=admin_headers
            )
            assert reply.status_code == 204, reply.text

        await join(v3.url)
        await apply(gateway, db, promoted("3"))
        assert await served_by(client) == {"tiny:3"}
        # Promoted to 4 while its replicas start: version 3 keeps answering, none fails.
        await apply(gateway, db, promoted("4", previous="3"))
        alias = await gateway.aliases.alias_named("forge-chat")
        assert alias is not None and (alias.target, alias.previous) == ("tiny:4", ModelRef("tiny", "3"))
        assert await served_by(client) == {"tiny:3"}
        assert {b["model"] for b in v3.bodies} == {"tiny:3"}
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert listed["forge-chat"]["alias_of"] == "tiny:3"  # what answers it now
        # The first replica of 4 joins the pool: the alias moves with the next request.
        v4 = await replicas(version="4")
        await join(v4.url)
        assert await served_by(client) == {"tiny:4"}
        assert {b["model"] for b in v4.bodies} == {"tiny:4"}
        # The rollout drains 3; then a rollback to 3 (whose replicas are gone) keeps 4 answering
        # until a replica of 3 is back.
        await leave(v3.url)
        await apply(gateway, db, promoted("3", previous="4", rollback=True))
        assert await served_by(client) == {"tiny:4"}
        v3_again = await replicas(version="3")
        await join(v3_again.url)
        assert await served_by(client) == {"tiny:3"}
        # An ejected replica is not ready: with 3's only replica gone dead, the alias goes back to
        # naming 4 while 4 still answers — and with neither served, it names its own version.
        await v3_again.stop()
        for _ in range(gateway.pool.policy.eject_after):
            await gateway.pool.refresh()
        assert await served_by(client) == {"tiny:4"}
        await v4.stop()
        for _ in range(gateway.pool.policy.eject_after):
            await gateway.pool.refresh()
        tenant = await gateway.tenants.authenticate("tenant-key")
        request = GenerationRequest.parse({"model": "forge-chat", "prompt": "hi"})
        assert (await gateway.router.route(tenant, "/v1/completions", request)).target == "tiny:3"


async def test_a_configured_upstream_that_lists_the_model_serves_a_promotion_at_once(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    db: Database,
    api_key: str,
) -> None:
    """A static upstream (``MODEL_SERVER_URL``: Forge's model server loads any registered version
    of a model it lists) is ready for every version of the names it lists: nothing is held."""
    static = await replicas(version="3")
    gateway = await make_gateway([static.url])
    await gateway.pool.refresh()
    await apply(gateway, db, promoted("3"), promoted("4", previous="3"))
    tenant = await gateway.tenants.authenticate(api_key)
    request = GenerationRequest.parse({"model": "forge-chat", "prompt": "hi"})
    assert (await gateway.router.route(tenant, "/v1/completions", request)).target == "tiny:4"


async def test_a_canary_promoted_to_production_ends_its_split_and_its_canary_alias(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    db: Database,
) -> None:
    stable, canary = await replicas(version="3"), await replicas(version="4")
    gateway = await make_gateway([stable.url, canary.url])
    await gateway.pool.refresh()
    await apply(gateway, db, promoted("3"), promoted("4", stage="canary", traffic=50))
    async with client_for(gateway) as client:
        assert await served_by(client, 40) == {"tiny:3", "tiny:4"}
        aliases = {a.alias: a for a in await gateway.aliases.list_aliases()}
        assert aliases["canary"].target == "tiny:4"
        await apply(gateway, db, promoted("4", previous="3"))
        aliases = {a.alias: a for a in await gateway.aliases.list_aliases()}
        assert set(aliases) == {"production", "forge-chat"}  # the canary stage is empty now
        for name in ("production", "forge-chat"):
            assert aliases[name].target == "tiny:4"
            assert (aliases[name].canary, aliases[name].canary_weight) == (None, 0)
        assert await served_by(client, 40) == {"tiny:4"}
        listed = (await client.get("/v1/models")).json()["data"]
        assert "canary" not in {m["id"] for m in listed}
        assert all("canary" not in m for m in listed)
        # A later canary splits the new stable as any canary does.
        await apply(gateway, db, promoted("3", stage="canary", traffic=50))
        assert await served_by(client, 40) == {"tiny:3", "tiny:4"}


async def test_a_canary_event_arriving_after_its_promotion_to_production_leaves_no_canary_alias(
    make_gateway: Callable[..., Awaitable[InferenceGateway]], db: Database
) -> None:
    """The registry keys its events by stage: the canary event of a version may arrive after the
    event that promoted that version on to production."""
    gateway = await make_gateway([])
    stable, canary, production = promoted("3"), promoted("4", stage="canary", traffic=10), promoted("4")
    for seconds, event in enumerate((stable, canary, production)):
        event.meta.occurred_at.FromSeconds(1_700_000_000 + seconds)
    await apply(gateway, db, stable, production, canary)
    aliases = {a.alias: a for a in await gateway.aliases.list_aliases()}
    assert set(aliases) == {"production", "forge-chat"}
    assert all((a.target, a.canary_weight) == ("tiny:4", 0) for a in aliases.values())
