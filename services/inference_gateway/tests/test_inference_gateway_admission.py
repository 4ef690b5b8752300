"""Priority admission and load shedding: the per-model queue, in process and through the HTTP API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from forge_inference_gateway.replicas.pool import ReplicaPool, RoutingPolicy
from forge_inference_gateway.replicas.upstream import ModelServerClient
from forge_inference_gateway.routing.admission import Admission, AdmissionPolicy, Lease, level_for
from forge_inference_gateway.service import InferenceGateway
from forge_kit import errors
from forge_kit.modelref import ModelRef

INTERACTIVE, BATCH = 0, 1
TINY = ModelRef("tiny")


def test_the_tenant_class_is_a_floor_the_request_can_only_lower() -> None:
    assert level_for("interactive", None) == INTERACTIVE
    assert level_for("interactive", 5) == BATCH
    assert level_for("batch", None) == BATCH
    assert level_for("batch", -10) == BATCH  # a batch tenant cannot buy its way up


def make_admission(max_inflight: int, max_queue: int, reserve: float = 0.0) -> Admission:
    """One replica with ``max_inflight`` slots; picks never touch the network."""
    pool = ReplicaPool(
        ["http://r1.test"],
        lambda url: ModelServerClient(url, None),
        RoutingPolicy(max_inflight=max_inflight, reserve=reserve),
    )
    return Admission(pool, AdmissionPolicy(max_queue=max_queue, retry_after_s=3.0))


def far() -> float:
    return time.monotonic() + 60


async def queued(admission: Admission, level: int) -> asyncio.Task[Lease]:
    task = asyncio.create_task(admission.acquire(TINY, level, [], far()))
    await asyncio.sleep(0)
    return task


async def test_interactive_goes_before_batch_that_queued_earlier() -> None:
    admission = make_admission(max_inflight=1, max_queue=8)
    lease = await admission.acquire(TINY, BATCH, [], far())
    pending = {"batch-1": await queued(admission, BATCH), "batch-2": await queued(admission, BATCH)}
    pending["interactive"] = await queued(admission, INTERACTIVE)
    assert admission.queued_by_level(TINY) == [1, 2]
    order = []
    while pending:
        lease.release()  # the freed slot goes to the queue's head
        await asyncio.wait(pending.values(), timeout=30, return_when=asyncio.FIRST_COMPLETED)
        (name,) = [name for name, task in pending.items() if task.done()]
        order.append(name)
        lease = pending.pop(name).result()
    lease.release()
    assert order == ["interactive", "batch-1", "batch-2"]


async def test_a_full_queue_sheds_the_newest_batch_request_for_an_interactive_one() -> None:
    admission = make_admission(max_inflight=1, max_queue=2)
    running = await admission.acquire(TINY, BATCH, [], far())
    old_batch, new_batch = await queued(admission, BATCH), await queued(admission, BATCH)
    interactive = await queued(admission, INTERACTIVE)
    with pytest.raises(errors.OverloadedError) as caught:
        await new_batch
    assert caught.value.retry_after_s == 3.0 and "batch request shed" in caught.value.message
    assert not old_batch.done() and not interactive.done()
    # Full of one interactive and one batch: another batch request is refused at once ...
    with pytest.raises(errors.OverloadedError):
        await admission.acquire(TINY, BATCH, [], far())
    # ... and another interactive one takes the batch request's place.
    second = await queued(admission, INTERACTIVE)
    with pytest.raises(errors.OverloadedError):
        await old_batch
    assert admission.queued_by_level(TINY) == [2, 0]
    # Only interactive requests are left: now the newest of them is the one refused.
    with pytest.raises(errors.OverloadedError) as caught:
        await admission.acquire(TINY, INTERACTIVE, [], far())
    assert "interactive request shed" in caught.value.message
    running.release()
    (await interactive).release()
    (await second).release()
    assert admission.in_flight(TINY) == 0 and admission.queued(TINY) == 0


async def test_a_waiter_past_its_deadline_leaves_the_queue() -> None:
    admission = make_admission(max_inflight=1, max_queue=4)
    running = await admission.acquire(TINY, INTERACTIVE, [], far())
    with pytest.raises(TimeoutError):
        await admission.acquire(TINY, INTERACTIVE, [], time.monotonic() + 0.05)
    assert admission.queued(TINY) == 0
    running.release()
    (await admission.acquire(TINY, INTERACTIVE, [], far())).release()


async def test_the_reserve_keeps_slots_for_interactive_while_batch_fills_the_rest() -> None:
    admission = make_admission(max_inflight=4, max_queue=16, reserve=0.5)
    batch = [await admission.acquire(TINY, BATCH, [], far()) for _ in range(2)]
    waiting_batch = await queued(admission, BATCH)
    # Interactive arrivals skip the queued batch request: there is room for them alone.
    interactive = [await admission.acquire(TINY, INTERACTIVE, [], far()) for _ in range(2)]
    assert not waiting_batch.done() and admission.in_flight(TINY) == 4
    # Batch runs only while the replica's load is under half its slots, whoever holds them.
    for held in (batch[0], interactive[0]):
        held.release()
        await asyncio.sleep(0.01)
        assert not waiting_batch.done()
    interactive[1].release()
    lease = await asyncio.wait_for(waiting_batch, 30)
    lease.release()
    batch[1].release()


# -- through the HTTP API --------------------------------------------------------------------

Start = Callable[..., Awaitable[Any]]


async def test_saturation_sheds_batch_with_429_and_retry_after_while_interactive_is_served(
    replicas: Start,
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    admin_headers: dict[str, str],
) -> None:
    upstream = await replicas(max_running=8)
    gateway = await make_gateway(
        [upstream.url],
        policy=RoutingPolicy(max_inflight=2, reserve=0.5),
        admission=AdmissionPolicy(max_queue=2, retry_after_s=4.0),
    )
    async with client_for(gateway) as admin:
        reply = await admin.post(
            "/admin/v1/tenants", json={"name": "evals", "priority_class": "batch"}, headers=admin_headers
        )
        batch_key = reply.json()["api_key"]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    upstream.hold()
    async with client_for(gateway, batch_key) as batch, client_for(gateway) as interactive:
        # One batch request runs (its half of the replica), two wait, the fourth is shed.
        batch_calls = [asyncio.create_task(batch.post("/v1/completions", json=body)) for _ in range(3)]
        while gateway.admission.queued(TINY) < 2:
            await asyncio.sleep(0.01)
        shed = await batch.post("/v1/completions", json=body)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "4"
        assert (
            shed.json()["error"]["type"] == "rate_limit_error" and "shed" in shed.json()["error"]["message"]
        )
        # An interactive request is served at once from the reserve, ahead of queued batch work.
        first = asyncio.create_task(interactive.post("/v1/completions", json={**body, "prompt": "y"}))
        while upstream.running < 2:
            await asyncio.sleep(0.01)
        assert gateway.admission.queued_by_level(TINY) == [0, 2]
        # A second interactive one queues; it displaces the newest batch waiter, never the reverse.
        second = asyncio.create_task(interactive.post("/v1/completions", json={**body, "prompt": "z"}))
        displaced = await asyncio.wait_for(batch_calls[2], 30)
        assert displaced.status_code == 429
        upstream.release()
        replies = await asyncio.gather(first, second, *batch_calls[:2])
    assert [r.status_code for r in replies] == [200, 200, 200, 200]
    served = [b["prompt"] for b in upstream.bodies]
    assert served.index("z") < len(served) - 1  # "z" went before the last queued batch request
    assert sorted((b["prompt"], b["priority"]) for b in upstream.bodies) == [
        ("x", 1),
        ("x", 1),
        ("y", 0),
        ("z", 0),
    ]


async def test_no_replica_at_all_is_503_with_retry_after(
    make_gateway: Callable[..., Awaitable[InferenceGateway]], client_for: Any
) -> None:
    gateway = await make_gateway(["http://127.0.0.1:9"], policy=RoutingPolicy(eject_after=1, eject_base_s=3))
    async with client_for(gateway) as client:
        for _ in range(2):
            reply = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert reply.status_code == 503 and reply.headers["retry-after"] in ("1", "3")
        assert reply.headers["retry-after"] == "3" and reply.json()["error"]["code"] == "unavailable"
