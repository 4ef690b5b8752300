"""The response cache: deterministic requests replayed per tenant and model version, never shared."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_inference_gateway.caching.response_cache import complete_stream, is_deterministic
from forge_inference_gateway.service import InferenceGateway
from forge_kit.cache import RedisCache
from forge_kit.db import Database
from forge_kit.events import new_meta

GREEDY = {"model": "tiny", "prompt": "To be", "max_tokens": 3, "temperature": 0}


def test_what_counts_as_deterministic() -> None:
    assert is_deterministic({"temperature": 0}) and is_deterministic({"temperature": 0.0})
    assert is_deterministic({"temperature": 0.9, "seed": 7})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.7})
    assert not is_deterministic({"temperature": False}) and not is_deterministic({"seed": "7"})
    assert complete_stream(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
    assert not complete_stream(b'data: {"choices": []}\n\n')
    assert not complete_stream(b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n')


@pytest.fixture
async def upstream(replicas: Callable[..., Awaitable[Any]]) -> Any:
    """A replica serving ``tiny`` at version 2 (``tiny`` and ``tiny:2`` both reach it)."""
    return await replicas(version="2")


@pytest.fixture
async def gateway_over(
    upstream: Any, make_gateway: Callable[..., Awaitable[InferenceGateway]]
) -> InferenceGateway:
    return await make_gateway([upstream.url])


async def test_a_greedy_request_is_answered_once_upstream_then_from_the_cache(
    upstream: Any, gateway_over: InferenceGateway, client_for: Any
) -> None:
    async with client_for(gateway_over) as client:
        first = await client.post("/v1/completions", json=GREEDY)
        again = await client.post("/v1/completions", json=GREEDY)
        seeded = {**GREEDY, "temperature": 0.8, "seed": 11}
        seeded_first, seeded_again = [await client.post("/v1/completions", json=seeded) for _ in range(2)]
        sampled = [
            await client.post("/v1/completions", json={**GREEDY, "temperature": 0.7}) for _ in range(2)
        ]
    assert (first.status_code, first.headers["x-forge-cache"]) == (200, "miss")
    assert (again.status_code, again.headers["x-forge-cache"]) == (200, "hit")
    assert again.content == first.content  # the same completion id: it was never generated again
    assert again.headers["x-forge-model"] == "tiny" and again.headers["content-type"] == "application/json"
    assert (seeded_first.headers["x-forge-cache"], seeded_again.headers["x-forge-cache"]) == ("miss", "hit")
    assert all("x-forge-cache" not in r.headers for r in sampled)
    assert [b.get("temperature") for b in upstream.bodies] == [0, 0.8, 0.7, 0.7]


async def test_a_stream_is_replayed_byte_for_byte(
    upstream: Any, gateway_over: InferenceGateway, client_for: Any
) -> None:
    body = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    relayed = []
    async with client_for(gateway_over) as client:
        for _ in range(2):
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                relayed.append(
                    (reply.headers["x-forge-cache"], b"".join([c async for c in reply.aiter_raw()]))
                )
        whole = await client.post("/v1/completions", json=GREEDY)
    assert [hit for hit, _ in relayed] == ["miss", "hit"] and relayed[0][1] == relayed[1][1]
    assert relayed[0][1].rstrip().endswith(b"data: [DONE]")
    assert whole.headers["x-forge-cache"] == "miss"  # a stream and a whole answer are different entries
    assert len(upstream.bodies) == 2


async def test_entries_are_never_shared_across_tenants_or_model_versions(
    upstream: Any,
    gateway_over: InferenceGateway,
    client_for: Any,
    db: Database,
    admin_headers: dict[str, str],
) -> None:
    async with client_for(gateway_over) as client:
        reply = await client.post("/admin/v1/tenants", json={"name": "other-app"}, headers=admin_headers)
        other_key = reply.json()["api_key"]
        assert (await client.post("/v1/completions", json=GREEDY)).headers["x-forge-cache"] == "miss"
        async with client_for(gateway_over, other_key) as other:
            assert (await other.post("/v1/completions", json=GREEDY)).headers["x-forge-cache"] == "miss"
            assert (await other.post("/v1/completions", json=GREEDY)).headers["x-forge-cache"] == "hit"
        # An alias shares entries with the model version it resolves to, and a promotion to
        # another version starts afresh.
        aliased = {**GREEDY, "model": "forge-chat"}
        for version, results in (("", ["hit", "hit"]), ("2", ["miss", "hit"])):
            event = events_pb2.ModelPromoted(
                meta=new_meta("eval"),
                model=common_pb2.ModelRef(name="tiny", version=version),
                stage="production",
                traffic_percent=100,
            )
            async with db.session() as session:
                await gateway_over.aliases.apply_model_promoted(event, session)
            replies = [await client.post("/v1/completions", json=aliased) for _ in range(2)]
            assert [r.headers["x-forge-cache"] for r in replies] == results
            assert replies[0].headers["x-forge-model"] == ("tiny:2" if version else "tiny")
    assert len(upstream.bodies) == 3


@pytest.fixture
async def redis() -> AsyncIterator[RedisCache]:
    cache = RedisCache("redis://127.0.0.1:6379/0", f"gateway-test-{uuid.uuid4().hex[:8]}")
    try:
        await cache.get("ping")
    except OSError as exc:  # pragma: no cover - the test machines run Redis
        pytest.skip(f"no Redis at 127.0.0.1:6379: {exc}")
    yield cache
    await cache.close()


@pytest.mark.integration
async def test_gateway_replicas_share_entries_through_redis(
    upstream: Any,
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    redis: RedisCache,
) -> None:
    first, second = [await make_gateway([upstream.url], cache=redis) for _ in range(2)]
    async with client_for(first) as one, client_for(second) as two:
        stored = await one.post("/v1/completions", json=GREEDY)
        replayed = await two.post("/v1/completions", json=GREEDY)
    assert (stored.headers["x-forge-cache"], replayed.headers["x-forge-cache"]) == ("miss", "hit")
    assert replayed.content == stored.content and len(upstream.bodies) == 1
