"""The autoscaling signal: how many model-server replicas each model should have.

Models are counted by name (every version of ``tiny`` together), as a model's replicas form one
deployment. For a model with ``ready`` healthy replicas:

1. by load: ``ceil(demand / target_per_replica)``, where demand is the requests queued at this
   gateway plus the estimated requests on the model's replicas (scraped waiting + running, and
   what this gateway sent since);
2. by latency: ``ceil(ready * ttft_p99 / ttft_slo)`` over the last ``window_s`` of time to first
   token seen by the gateway, once ``min_samples`` are in (proportional control, as an HPA does
   with a utilisation target);
3. desired = the larger, within ``[min_replicas, max_replicas]``.

Exported as the gauge ``forge_gateway_desired_replicas{model}`` (what an HPA External metric or a
KEDA Prometheus scaler acts on, with a target of 1 per replica) and through the admin API. The
clock is injected so the arithmetic runs under a fake one in tests.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Gauge

from forge_inference_gateway.routing.admission import Admission
from forge_kit.modelref import ModelRef

DESIRED = Gauge(
    "forge_gateway_desired_replicas", "Model-server replicas the gateway asks for, per model", ["model"]
)
READY = Gauge("forge_gateway_ready_replicas", "Healthy model-server replicas serving a model", ["model"])
DEMAND = Gauge(
    "forge_gateway_model_demand", "Requests queued at the gateway plus on replicas, per model", ["model"]
)


@dataclass(frozen=True)
class AutoscalePolicy:
    target_per_replica: float = 16.0
    ttft_slo_s: float = 2.0
    window_s: float = 60.0
    min_samples: int = 20
    min_replicas: int = 1
    max_replicas: int = 16


@dataclass(frozen=True)
class Recommendation:
    model: str
    ready_replicas: int
    queued: int
    in_flight: int
    demand: float
    ttft_p99_s: float | None
    by_load: int
    by_latency: int | None
    desired_replicas: int


class Autoscaler:
    """Keeps recent TTFT samples per model and turns them, with queue depth, into a replica count.

    The gateway calls :meth:`observe` after each first token and :meth:`publish` from its control
    loop; the admin API calls :meth:`recommend`.
    """

    def __init__(
        self,
        admission: Admission,
        policy: AutoscalePolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admission = admission
        self.policy = policy or AutoscalePolicy()
        self._clock = clock
        self._ttft: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, target: ModelRef, ttft_s: float) -> None:
        """A time to first token of a request routed to ``target`` (every version counts toward its name)."""
        samples = self._ttft.setdefault(target.name, deque(maxlen=10_000))
        samples.append((self._clock(), ttft_s))

    def _p99(self, model: str) -> tuple[float | None, int]:
        samples = self._ttft.get(model)
        if not samples:
            return None, 0
        horizon = self._clock() - self.policy.window_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
        values = sorted(v for _, v in samples)
        if not values:
            return None, 0
        return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)], len(values)

    def models(self) -> set[str]:
        pool = self._admission.pool
        served = {name for r in pool.replicas() if r.cards for name in r.cards}
        routed = {target.name for target in self._admission.models()}
        return served | routed | {m for m, s in self._ttft.items() if s}

    def recommend(self, model: str) -> Recommendation:
        """Steps 1-3 of the module docstring for ``model``."""
        policy = self.policy
        admission = self._admission
        replicas = [r for r in admission.pool.replicas() if r.healthy and r.served(model) is not None]
        targets = [t for t in admission.models() if t.name == model]
        queued = sum(admission.queued(t) for t in targets)
        demand = queued + sum(r.estimated_load() for r in replicas)
        by_load = math.ceil(demand / policy.target_per_replica)
        p99, count = self._p99(model)
        by_latency = None
        if p99 is not None and count >= policy.min_samples and replicas:
            by_latency = math.ceil(len(replicas) * p99 / policy.ttft_slo_s)
        desired = max(by_load, by_latency or 0)
        desired = min(policy.max_replicas, max(policy.min_replicas, desired))
        return Recommendation(
            model=model,
            ready_replicas=len(replicas),
            queued=queued,
            in_flight=sum(admission.in_flight(t) for t in targets),
            demand=demand,
            ttft_p99_s=p99,
            by_load=by_load,
            by_latency=by_latency,
            desired_replicas=desired,
        )

    def publish(self) -> list[Recommendation]:
        """Recompute every model's recommendation and set the gauges."""
        out = []
        for model in sorted(self.models()):
            rec = self.recommend(model)
            DESIRED.labels(model).set(rec.desired_replicas)
            READY.labels(model).set(rec.ready_replicas)
            DEMAND.labels(model).set(rec.demand)
            out.append(rec)
        return out
