"""Endpoint picking across replicas: load from vLLM gauges, prefix affinity, ejection, membership.

The policy tests touch no network (a pick never calls a replica); the health and membership
tests run real vLLM-protocol servers (:class:`ProtocolReplica`) behind the gateway.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pydantic
import pytest

from forge_inference_gateway.config import InferenceGatewaySettings
from forge_inference_gateway.replicas.pool import (
    Load,
    NoReplicaError,
    Replica,
    ReplicaPool,
    RoutingPolicy,
    fold_versions,
    parse_load,
)
from forge_inference_gateway.replicas.upstream import ModelServerClient, UpstreamUnavailableError
from forge_inference_gateway.service import InferenceGateway
from forge_kit import errors
from forge_kit.modelref import ModelRef

# What `vllm serve` (0.x, V1 engine) exposes, trimmed: two engines' gauges and unrelated series.
VLLM_EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.62
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B"} 12.0
process_resident_memory_bytes 1.2e+09
"""


def test_parse_load_sums_queues_and_takes_the_fullest_kv_cache() -> None:
    assert parse_load(VLLM_EXPOSITION) == Load(waiting=3.0, running=12.0, kv_usage=0.62)
    older = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.9\nvllm:num_requests_waiting{model_name="m"} NaN\n'
    assert parse_load(older) == Load(waiting=0.0, running=0.0, kv_usage=0.9)
    assert parse_load("") == Load()


TINY = ModelRef("tiny")
URLS = ["http://r1.test", "http://r2.test", "http://r3.test"]


def make_pool(policy: RoutingPolicy | None = None, urls: list[str] = URLS) -> ReplicaPool:
    return ReplicaPool(
        urls,
        lambda url: ModelServerClient(url, None),
        policy or RoutingPolicy(max_inflight=8),
        rng=random.Random(1),
    )


def with_state(
    replica: Replica,
    *,
    waiting: float = 0,
    running: float = 0,
    kv: float = 0.0,
    models: dict[str, str] | None = None,
) -> Replica:
    """Builder: what the replica's last scrape said."""
    replica.load = Load(waiting=waiting, running=running, kv_usage=kv)
    replica.inflight_at_scrape = replica.inflight
    if models is not None:
        replica.cards = {name: {"id": name, "version": version} for name, version in models.items()}
    return replica


def test_least_loaded_replica_wins_counting_what_was_sent_since_the_scrape() -> None:
    pool = make_pool()
    r1, r2, r3 = pool.replicas()
    with_state(r1, waiting=2, running=4)
    with_state(r2, running=1)
    with_state(r3, running=3, kv=0.1)
    picks = [pool.pick(TINY, 0, []) for _ in range(4)]
    # Scores are load/8 + KV use: r2 wins until what this gateway sent it since the scrape
    # (3 more) outweighs r3's 3/8 + 0.1.
    assert [p.replica.url if p else None for p in picks] == [r2.url, r2.url, r2.url, r3.url]
    assert r2.estimated_load() == 4 and all(p is not None and p.reason == "least_load" for p in picks)


def test_batch_stops_at_the_interactive_reserve_and_a_full_kv_cache() -> None:
    pool = make_pool(RoutingPolicy(max_inflight=4, reserve=0.5), urls=URLS[:1])
    (replica,) = pool.replicas()
    assert pool.pick(TINY, 1, []) and pool.pick(TINY, 1, [])
    assert pool.pick(TINY, 1, []) is None  # batch may use 2 of 4 slots
    assert pool.pick(TINY, 0, []) and pool.pick(TINY, 0, [])
    assert pool.pick(TINY, 0, []) is None
    pool.release(replica)
    with_state(replica, kv=0.97)
    assert pool.pick(TINY, 1, []) is None
    assert pool.pick(TINY, 0, []) is not None


def test_only_replicas_serving_the_version_are_candidates() -> None:
    pool = make_pool()
    r1, r2, r3 = pool.replicas()
    with_state(r1, models={"tiny": "3"})
    with_state(r2, models={"tiny": "4"})
    with_state(r3, models={"other": ""})
    assert [r.url for r in pool.candidates(ModelRef("tiny", "4"))] == [r2.url]
    assert {r.url for r in pool.candidates(TINY)} == {r1.url, r2.url}
    # Nobody serves it: any healthy replica, whose 404 reaches the caller.
    assert len(pool.candidates(ModelRef("huge"))) == 3
    # The version that answers: a pinned one as asked, else the one the replica lists.
    assert str(r1.answering(ModelRef("tiny"))) == "tiny:3"
    assert str(r2.answering(ModelRef("tiny", "4"))) == "tiny:4"
    assert str(r3.answering(ModelRef("other"))) == "other"
    assert r1.served("huge") is None and r1.serves(ModelRef("huge")) is False


def test_a_vllm_replica_answering_to_name_and_version_serves_that_version_only() -> None:
    """vLLM's cards have no version: a deployment serves ``tiny`` also as ``tiny:4``."""
    vllm = {"tiny": {"id": "tiny", "owned_by": "vllm"}, "tiny:4": {"id": "tiny:4", "owned_by": "vllm"}}
    assert fold_versions(vllm) == {"tiny": {"id": "tiny", "owned_by": "vllm", "version": "4"}}
    # A card that has a version, or a name:version with no name card, stays as it is.
    forge = {"tiny": {"id": "tiny", "version": "3"}, "tiny:4": {"id": "tiny:4"}, "x:1": {"id": "x:1"}}
    assert fold_versions(forge) == forge
    pool = make_pool()
    r1, r2, _ = pool.replicas()
    r1.cards, r2.cards = fold_versions(vllm), fold_versions({"tiny": {"id": "tiny"}, "tiny:3": {}})
    assert [r.url for r in pool.candidates(ModelRef("tiny", "4"))] == [r1.url]
    assert [r.url for r in pool.candidates(ModelRef("tiny", "3"))] == [r2.url]


def test_prefix_affinity_keeps_a_shared_prompt_on_one_replica_until_it_is_too_busy() -> None:
    pool = make_pool(RoutingPolicy(max_inflight=8, affinity_slack=0.25, block_chars=16))
    system = "You are a terse assistant. Answer in one line. " * 4
    first = pool.pick(TINY, 0, pool.prefixes.keys(system + "Q: one?"))
    assert first is not None and first.reason == "least_load"
    home = first.replica
    follow = pool.pick(TINY, 0, pool.prefixes.keys(system + "Q: two?"))
    assert follow is not None and (follow.replica, follow.reason) == (home, "prefix")
    # A different prompt goes by load; the shared one stays home while home is within the slack
    # (2/8 of a replica) of the least loaded, then spills over.
    other = pool.pick(TINY, 0, pool.prefixes.keys("Translate to French: " * 8))
    assert other is not None and other.replica is not home
    home.inflight += 1
    spill = pool.pick(TINY, 0, pool.prefixes.keys(system + "Q: three?"))
    assert spill is not None and spill.replica is not home and spill.reason == "least_load"
    # The spill-over replica now holds the prefix too; both are affine from here on.
    assert set(pool.prefixes.matches(pool.prefixes.keys(system))) == {home.url, spill.replica.url}


def test_failures_eject_with_doubling_back_off_and_success_restores() -> None:
    now = [100.0]
    pool = ReplicaPool(
        URLS[:2],
        lambda url: ModelServerClient(url, None),
        RoutingPolicy(eject_after=2, eject_base_s=2.0, eject_max_s=5.0),
        clock=lambda: now[0],
    )
    r1, r2 = pool.replicas()
    down = UpstreamUnavailableError("connection refused")
    pool.report_failure(r1, down)
    assert r1.healthy
    pool.report_failure(r1, down)
    assert not r1.healthy and r1.ejected_until == 102.0
    assert [r.url for r in pool.candidates(TINY)] == [r2.url]
    pool.report_failure(r1, down)  # a failed probe after the back-off
    pool.report_failure(r1, down)
    assert r1.ejected_until == 105.0  # 2 → 4 → capped at 5
    pool.report_failure(r2, down)
    pool.report_failure(r2, down)
    with pytest.raises(NoReplicaError) as caught:
        pool.pick(TINY, 0, [])
    assert caught.value.retry_after_s == pytest.approx(2.0)  # r2's probe is the soonest
    pool.report_success(r1)
    assert r1.healthy and r1.failures == 0 and pool.pick(TINY, 0, []) is not None


def test_replica_urls_are_validated() -> None:
    pool = make_pool()
    for bad in ("ftp://x", "not a url", "http://"):
        with pytest.raises(errors.ValidationError) as caught:
            pool.add(bad)
        assert caught.value.field == "url"
    with pytest.raises(errors.AlreadyExistsError):
        pool.add(URLS[0] + "/")


def test_configured_replicas_may_be_none_and_each_url_is_checked_at_start() -> None:
    assert InferenceGatewaySettings(model_server_url="").replica_urls() == []
    both = InferenceGatewaySettings(model_server_url=f" {URLS[0]}, {URLS[1]}/ ,")
    assert both.replica_urls() == [URLS[0], f"{URLS[1]}/"]
    with pytest.raises(pydantic.ValidationError, match="model_server_url: must be http"):
        InferenceGatewaySettings(model_server_url=f"{URLS[0]},ftp://x")
    empty = make_pool(urls=[])
    with pytest.raises(NoReplicaError, match="replica pool is empty") as caught:
        empty.pick(TINY, 0, [])
    assert caught.value.retry_after_s == 1.0


async def test_added_replicas_get_their_own_token_and_a_new_client_when_it_changes() -> None:
    made: list[tuple[str, str | None]] = []

    def configured(url: str) -> ModelServerClient:
        made.append((url, "gateway-token"))
        return ModelServerClient(url, "gateway-token")

    def added(url: str, token: str) -> ModelServerClient:
        made.append((url, token))
        return ModelServerClient(url, token or None)

    pool = ReplicaPool([URLS[0]], configured, admin_client_factory=added)
    await pool.sync({URLS[1]: "", URLS[2]: "t2"})
    assert made == [(URLS[0], "gateway-token"), (URLS[1], ""), (URLS[2], "t2")]
    first = pool.get(URLS[2]).client
    await pool.sync({URLS[1]: "", URLS[2]: "t2"})  # unchanged: same clients
    assert pool.get(URLS[2]).client is first and len(made) == 3
    await pool.sync({URLS[2]: "rotated"})  # r2 gone, r3's token rotated
    assert not pool.has(URLS[1]) and pool.get(URLS[2]).client is not first
    assert made[-1] == (URLS[2], "rotated") and pool.has(URLS[0])


# -- against real vLLM-protocol servers ------------------------------------------------------

Start = Callable[..., Awaitable[Any]]
Make = Callable[..., Awaitable[InferenceGateway]]
HI = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, bytes]:
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        return reply.status_code, b"".join([c async for c in reply.aiter_raw()])


async def test_scraped_queue_depth_steers_traffic_away_from_a_busy_replica(
    replicas: Start, make_gateway: Make, client_for: Any
) -> None:
    busy, idle = await replicas(max_running=2), await replicas(max_running=2)
    gateway = await make_gateway([busy.url, idle.url])
    # Another gateway's traffic: 2 running and 2 waiting on `busy`, which only /metrics shows.
    busy.hold()
    async with httpx.AsyncClient(base_url=busy.url, timeout=10) as direct:
        others = [asyncio.create_task(direct.post("/v1/completions", json=HI)) for _ in range(4)]
        while busy.waiting < 2:
            await asyncio.sleep(0.01)
        await gateway.pool.refresh()
        async with client_for(gateway) as client:
            results = [await _stream(client, {**HI, "prompt": f"q{i}"}) for i in range(5)]
        busy.release()
        await asyncio.gather(*others)
    assert [status for status, _ in results] == [200] * 5
    assert all(body.rstrip().endswith(b"data: [DONE]") for _, body in results)
    assert len(idle.bodies) == 5 and len(busy.bodies) == 4
    assert idle.bodies[0]["priority"] == 0  # the admission level travels as vLLM's priority


async def test_a_dead_replica_is_retried_around_ejected_and_taken_back(
    replicas: Start, make_gateway: Make, client_for: Any, admin_headers: dict[str, str]
) -> None:
    stays, dies = await replicas(), await replicas()
    gateway = await make_gateway([stays.url, dies.url], policy=RoutingPolicy(eject_after=1, eject_base_s=0.2))
    await gateway.pool.refresh()
    port = dies.port
    await dies.stop()
    async with client_for(gateway) as client:
        results = [await _stream(client, {**HI, "prompt": f"q{i}"}) for i in range(6)]
        assert [status for status, _ in results] == [200] * 6  # no caller saw the dead replica
        reply = await client.get("/admin/v1/replicas", headers=admin_headers)
        listed = {r["url"]: r for r in reply.json()["replicas"]}
        assert listed[dies.url]["healthy"] is False and "unreachable" in listed[dies.url]["last_error"]
        assert listed[stays.url]["healthy"] is True and len(stays.bodies) == 6
        # The replica comes back on the same port; the first probe after the back-off restores it.
        await dies.start(port)
        await asyncio.sleep(0.25)
        await gateway.pool.refresh()
        assert gateway.pool.get(dies.url).healthy
        # Four at once: the gateway's own in-flight counts spread them over both replicas.
        results = await asyncio.gather(*(_stream(client, {**HI, "prompt": f"r{i}"}) for i in range(4)))
    assert [status for status, _ in results] == [200] * 4 and len(dies.bodies) == 2


async def test_replicas_are_added_and_removed_at_run_time_through_the_admin_api(
    replicas: Start, make_gateway: Make, client_for: Any, admin_headers: dict[str, str]
) -> None:
    first, second = await replicas(), await replicas()
    gateway = await make_gateway([first.url])
    admin = admin_headers
    async with client_for(gateway) as client:
        reply = await client.post("/admin/v1/replicas", json={"url": second.url + "/"}, headers=admin)
        assert reply.status_code == 201 and reply.json()["url"] == second.url
        assert (
            await client.post("/admin/v1/replicas", json={"url": second.url}, headers=admin)
        ).status_code == 409
        # The configured replica is there already too, and the 409 leaves nothing in the store.
        assert (
            await client.post("/admin/v1/replicas", json={"url": first.url}, headers=admin)
        ).status_code == 409
        reply = await client.post("/admin/v1/replicas", json={"url": "gopher://x"}, headers=admin)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "url"
        await gateway.pool.refresh()
        models = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["ready_replicas"]) for m in models] == [("tiny", 2)]
        # Another gateway replica sharing the store picks the added replica up on its next sync.
        peer = await make_gateway([first.url])
        await peer.replicas.sync_replicas()
        assert [r.url for r in peer.pool.replicas()] == sorted([first.url, second.url])
        reply = await client.delete("/admin/v1/replicas", params={"url": first.url}, headers=admin)
        assert reply.status_code == 409  # configured, not the admin API's to remove
        reply = await client.delete("/admin/v1/replicas", params={"url": second.url}, headers=admin)
        assert reply.status_code == 204
        await peer.replicas.sync_replicas()
        assert [r.url for r in peer.pool.replicas()] == [first.url]
        for i in range(3):
            assert (await _stream(client, {**HI, "prompt": f"q{i}"}))[0] == 200
    assert len(first.bodies) == 3 and second.bodies == []
    # A gateway configured without ``first`` finds no admin-added replica left in the store.
    other = await make_gateway([second.url])
    await other.replicas.sync_replicas()
    assert [r.url for r in other.pool.replicas()] == [second.url]
