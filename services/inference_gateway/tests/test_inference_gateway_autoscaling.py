"""The autoscaling signal: desired replicas from queue depth and TTFT against the SLO, under a fake clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import REGISTRY

from forge_inference_gateway.replicas.autoscaling import AutoscalePolicy, Autoscaler
from forge_inference_gateway.replicas.pool import Load, ReplicaPool, RoutingPolicy
from forge_inference_gateway.replicas.upstream import ModelServerClient
from forge_inference_gateway.routing.admission import Admission, AdmissionPolicy
from forge_inference_gateway.service import InferenceGateway
from forge_kit.modelref import ModelRef


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def scaler(clock: Clock, **policy: Any) -> tuple[ReplicaPool, Admission, Autoscaler]:
    pool = ReplicaPool(
        ["http://r1.test", "http://r2.test"],
        lambda url: ModelServerClient(url, None),
        RoutingPolicy(max_inflight=32),
        clock=clock,
    )
    for replica in pool.replicas():
        replica.cards = {"tiny": {"id": "tiny"}}
    admission = Admission(pool, AdmissionPolicy(), clock=clock)
    defaults = {"target_per_replica": 16.0, "ttft_slo_s": 2.0, "min_samples": 10, "max_replicas": 8}
    return pool, admission, Autoscaler(admission, AutoscalePolicy(**(defaults | policy)), clock=clock)


def test_desired_replicas_follow_the_queue_depth_on_the_replicas() -> None:
    clock = Clock()
    pool, _, autoscaler = scaler(clock)
    assert autoscaler.recommend("tiny").desired_replicas == 1  # idle: the floor
    r1, r2 = pool.replicas()
    r1.load, r2.load = Load(waiting=10, running=30), Load(running=24)
    rec = autoscaler.recommend("tiny")
    assert (rec.ready_replicas, rec.demand, rec.by_load, rec.desired_replicas) == (2, 64, 4, 4)
    r1.load = Load(waiting=200, running=32)
    assert autoscaler.recommend("tiny").desired_replicas == 8  # capped at max_replicas
    autoscaler.publish()
    assert REGISTRY.get_sample_value("forge_gateway_desired_replicas", {"model": "tiny"}) == 8
    assert REGISTRY.get_sample_value("forge_gateway_ready_replicas", {"model": "tiny"}) == 2


def test_a_slow_first_token_asks_for_more_replicas_until_the_window_forgets_it() -> None:
    clock = Clock()
    _, _, autoscaler = scaler(clock)
    for _ in range(9):
        autoscaler.observe(ModelRef("tiny", "3"), 5.0)  # every version counts toward the model
    assert autoscaler.recommend("tiny").by_latency is None  # too few samples to act on
    autoscaler.observe(ModelRef("tiny"), 5.0)
    rec = autoscaler.recommend("tiny")
    # 2 replicas at p99 5 s against a 2 s SLO: ceil(2 * 5 / 2) = 5.
    assert (rec.ttft_p99_s, rec.by_latency, rec.desired_replicas) == (5.0, 5, 5)
    clock.now += 61
    assert autoscaler.recommend("tiny").desired_replicas == 1


async def test_queued_requests_count_and_the_admin_api_reports_the_signal(
    replicas: Callable[..., Awaitable[Any]],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    admin_headers: dict[str, str],
) -> None:
    upstream = await replicas(max_running=4)
    gateway = await make_gateway([upstream.url], policy=RoutingPolicy(max_inflight=2))
    gateway.autoscaler.policy = AutoscalePolicy(target_per_replica=2.0, max_replicas=16)
    await gateway.pool.refresh()
    leases = [
        await gateway.admission.acquire(ModelRef("tiny"), 0, [], time.monotonic() + 60) for _ in range(2)
    ]
    # Two hold the replica's slots, and four more wait at the gateway.
    waiting = [gateway.admission.acquire(ModelRef("tiny"), 1, [], time.monotonic() + 60) for _ in range(4)]
    tasks = [asyncio.create_task(w) for w in waiting]
    await asyncio.sleep(0.01)
    async with client_for(gateway) as client:
        reply = await client.get("/admin/v1/autoscaling", headers=admin_headers)
        assert (await client.get("/admin/v1/autoscaling")).status_code == 401
    (model,) = reply.json()["models"]
    assert model["model"] == "tiny" and model["queued"] == 4 and model["in_flight"] == 2
    assert model["desired_replicas"] == 3  # (4 queued + 2 on the replica) / 2 per replica
    for lease in leases:
        lease.release()
    for task in tasks:
        (await task).release()
