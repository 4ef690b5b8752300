"""Admission: a bounded priority queue per model in front of the replicas, and load shedding.

A request takes a :class:`Lease` — a slot on one replica, picked by :class:`ReplicaPool` — for as
long as it runs upstream. When no replica has room for it, it waits in its model's queue, best
priority first, then oldest first (as vLLM's priority scheduler orders its waiting queue). A
slot freed by a finished request, a scrape that shows spare capacity or a replica coming back
hands slots to the queue's head.

Priority levels: 0 is interactive, 1 is batch (see :func:`level_for`). The pool holds a share of
every replica for level 0 (``RoutingPolicy.reserve``), so interactive requests do not queue
behind batch ones while batch traffic fills the rest.

The queue is bounded (``max_queue``). When it is full, the lowest-priority, newest waiter is shed
with 429 and ``Retry-After``, and if that would be the newcomer itself, the newcomer is refused:
an interactive request is never refused while a batch request still holds a place in the queue.
A waiter whose deadline passes leaves the queue with a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from forge_inference_gateway.replicas.pool import Replica, ReplicaPool
from forge_kit import errors
from forge_kit.modelref import ModelRef

#: Admission classes, best first; a tenant's class is the best level its requests can get.
LEVELS = ("interactive", "batch")

QUEUE_DEPTH = Gauge("forge_gateway_queue_depth", "Requests waiting for a replica slot", ["model", "priority"])
IN_FLIGHT = Gauge("forge_gateway_in_flight", "Requests holding a replica slot", ["model"])
SHED = Counter(
    "forge_gateway_shed_total", "Requests refused because the model's queue was full", ["model", "priority"]
)
QUEUE_WAIT = Histogram(
    "forge_gateway_queue_wait_seconds",
    "Time from arrival to a replica slot",
    ["priority"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def level_for(tenant_class: str, requested: int | None) -> int:
    """The admission level of a request: its tenant's class, lowered (never raised) by the request.

    ``requested`` is the OpenAI body's ``priority`` (vLLM's meaning: lower runs first); a positive
    value asks to be treated as batch. A tenant cannot buy a better class with the field.
    """
    floor = LEVELS.index(tenant_class) if tenant_class in LEVELS else len(LEVELS) - 1
    asked = 1 if requested is not None and requested > 0 else 0
    return max(floor, asked)


@dataclass(frozen=True)
class AdmissionPolicy:
    max_queue: int = 256
    """Requests that may wait per model; beyond it the lowest priority is shed."""

    retry_after_s: float = 2.0
    """``Retry-After`` given to shed requests."""


@dataclass(eq=False)
class _Waiter:
    level: int
    seq: int
    prefix: list[bytes]
    exclude: frozenset[str]
    arrived: float
    future: asyncio.Future[Lease] = field(repr=False)


class Lease:
    """A slot on one replica for one request; :meth:`release` (idempotent) gives it back."""

    def __init__(
        self, admission: Admission, model: ModelRef, replica: Replica, level: int, reason: str
    ) -> None:
        self._admission = admission
        self.model = model
        self.replica = replica
        self.level = level
        self.reason = reason
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._admission._release(self)


class Admission:
    """Per-model bounded priority queues over one :class:`ReplicaPool`.

    Called by the gateway for every request that goes upstream (``acquire``, then the lease's
    ``release``), and by the pool whenever capacity may have appeared (``pump``).
    """

    def __init__(
        self,
        pool: ReplicaPool,
        policy: AdmissionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.policy = policy or AdmissionPolicy()
        self._clock = clock
        self._queues: dict[ModelRef, list[_Waiter]] = {}
        self._in_flight: dict[ModelRef, int] = {}
        self._seq = itertools.count()
        pool.subscribe(self.pump)

    def queued(self, model: ModelRef) -> int:
        return len(self._queues.get(model, ()))

    def queued_by_level(self, model: ModelRef) -> list[int]:
        counts = [0] * len(LEVELS)
        for waiter in self._queues.get(model, ()):
            counts[waiter.level] += 1
        return counts

    def in_flight(self, model: ModelRef) -> int:
        return self._in_flight.get(model, 0)

    def models(self) -> set[ModelRef]:
        return {m for m, q in self._queues.items() if q} | {m for m, n in self._in_flight.items() if n}

    async def acquire(
        self,
        model: ModelRef,
        level: int,
        prefix: list[bytes],
        deadline: float,
        exclude: frozenset[str] = frozenset(),
    ) -> Lease:
        """A slot for a request to ``model``, now or once one frees up.

        1. if nobody queued for the model would go before it (same or better priority) and a
           replica has room for its priority, take the slot at once;
        2. otherwise queue, shedding the worst waiter when the queue is over its bound (429);
        3. wait for :meth:`pump` to hand over a slot, or for the deadline (``TimeoutError``).
        Raises :class:`~forge_inference_gateway.replicas.pool.NoReplicaError` when no healthy replica can
        serve the model at all.
        """
        arrived = self._clock()
        queue = self._queues.setdefault(model, [])
        # 1. The fast path keeps the queue's order: nobody it would overtake is waiting.
        if all(w.level > level for w in queue):
            pick = self.pool.pick(model, level, prefix, exclude)
            if pick is not None:
                QUEUE_WAIT.labels(LEVELS[level]).observe(0.0)
                return self._lease(model, pick.replica, level, pick.reason)
        else:
            self.pool.check_servable(model, exclude)
        # 2. Queue, then keep the bound by shedding the lowest priority, newest first.
        waiter = _Waiter(
            level, next(self._seq), prefix, exclude, arrived, asyncio.get_running_loop().create_future()
        )
        queue.append(waiter)
        if len(queue) > self.policy.max_queue:
            worst = max(queue, key=lambda w: (w.level, w.seq))
            queue.remove(worst)
            SHED.labels(str(model), LEVELS[worst.level]).inc()
            shed = errors.OverloadedError(
                f"model {str(model)!r} is saturated: {LEVELS[worst.level]} request shed "
                f"({self.policy.max_queue} waiting)",
                self.policy.retry_after_s,
            )
            if worst is waiter:
                self._publish(model)
                raise shed
            worst.future.set_exception(shed)
        self._publish(model)
        self.pump()
        # 3. Wait for a slot.
        try:
            async with asyncio.timeout(max(0.0, deadline - self._clock())):
                lease = await asyncio.shield(waiter.future)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                waiter.future.result().release()  # handed over just as the deadline passed
            self._drop(model, waiter)
            raise TimeoutError(f"deadline exceeded waiting for a {str(model)!r} replica") from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                waiter.future.result().release()
            self._drop(model, waiter)
            raise
        QUEUE_WAIT.labels(LEVELS[level]).observe(self._clock() - arrived)
        return lease

    def pump(self) -> None:
        """Hand free slots to queue heads, best priority first; fail waiters no replica can serve."""
        for model, queue in self._queues.items():
            changed = False
            while queue:
                head = min(queue, key=lambda w: (w.level, w.seq))
                try:
                    pick = self.pool.pick(model, head.level, head.prefix, head.exclude)
                except errors.ForgeError as exc:
                    # No healthy replica left for this waiter: nothing will come for it by waiting.
                    queue.remove(head)
                    changed = True
                    if not head.future.done():
                        head.future.set_exception(exc)
                    continue
                if pick is None:
                    break
                queue.remove(head)
                changed = True
                head.future.set_result(self._lease(model, pick.replica, head.level, pick.reason))
            if changed:
                self._publish(model)

    def _lease(self, model: ModelRef, replica: Replica, level: int, reason: str) -> Lease:
        self._in_flight[model] = self._in_flight.get(model, 0) + 1
        IN_FLIGHT.labels(str(model)).set(self._in_flight[model])
        return Lease(self, model, replica, level, reason)

    def _release(self, lease: Lease) -> None:
        self._in_flight[lease.model] -= 1
        IN_FLIGHT.labels(str(lease.model)).set(self._in_flight[lease.model])
        self.pool.release(lease.replica)
        self.pump()

    def _drop(self, model: ModelRef, waiter: _Waiter) -> None:
        queue = self._queues.get(model, [])
        if waiter in queue:
            queue.remove(waiter)
            self._publish(model)

    def _publish(self, model: ModelRef) -> None:
        for level, count in enumerate(self.queued_by_level(model)):
            QUEUE_DEPTH.labels(str(model), LEVELS[level]).set(count)
