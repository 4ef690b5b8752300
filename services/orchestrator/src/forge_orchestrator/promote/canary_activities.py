"""Activities of the guarded canary (:mod:`forge_orchestrator.promote.canary`): its policy file, the
gateway's metrics, and one look of the sequential analysis (:func:`forge_experiments.canary.analyze`).

The gateway's ``/metrics`` (every replica's, summed) are read over HTTP, from each replica or
from a Prometheus server's federation endpoint (the settings' ``canary_metrics_urls``); none means
there is no gateway to watch, so the canary sees no traffic (and is never promoted by default). A
gateway that cannot be reached fails the activity, which Temporal retries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_experiments.canary import CanaryPolicy, SplitCounts, analyze, load_policy, parse_metrics
from forge_kit import errors

MAX_METRICS_BYTES = 16 * 1024 * 1024


@dataclass
class Counts:
    """:class:`~forge_experiments.canary.SplitCounts` as Temporal's JSON carries it."""

    statuses: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)
    itl: dict[str, float] = field(default_factory=dict)
    empty: float = 0.0

    @classmethod
    def of(cls, counts: SplitCounts) -> Counts:
        return cls(**asdict(counts))

    def split(self) -> SplitCounts:
        return SplitCounts(dict(self.statuses), dict(self.ttft), dict(self.itl), self.empty)


@dataclass
class PolicyInput:
    family: str
    """The workflow input's ``canary_policy``; empty: the default."""
    model_family: str
    """The model's name as a family name (the last resort)."""


@dataclass
class SnapshotInput:
    canary: str
    """``name:version`` of the canary, as the gateway labels it."""
    production: str


@dataclass
class Snapshot:
    canary: Counts
    production: Counts


@dataclass
class LookInput:
    policy: dict[str, Any]
    start: Snapshot
    now: Snapshot
    elapsed_s: float
    extensions: int
    previous: dict[str, list[float]] = field(default_factory=dict)
    paused: bool = False


@dataclass
class Look:
    decision: str
    """``promote``, ``rollback``, ``extend`` or ``continue``."""
    reason: str
    evidence: str
    """JSON: the analysis (:meth:`forge_experiments.canary.Analysis.evidence`)."""
    p_values: dict[str, list[float]] = field(default_factory=dict)
    canary_requests: int = 0
    production_requests: int = 0


class CanaryActivities:
    """Policy files and gateway metrics for workflows."""

    def __init__(
        self,
        metrics_urls: Sequence[str] = (),
        *,
        policy_dir: Path | None = None,
        default_family: str = "",
        timeout_s: float = 10.0,
    ) -> None:
        self._urls = [u for u in metrics_urls if u]
        self._default_family = default_family
        self._policy_dir = policy_dir
        self._timeout_s = timeout_s

    def methods(self) -> list[Any]:
        return [self.canary_policy, self.canary_snapshot, self.canary_look]

    @activity.defn(name="canary_policy")
    async def canary_policy(self, params: PolicyInput) -> dict[str, Any]:
        """The policy as a dict: the input's family, else this process's default family, else the
        model's name (each: its file, else ``default.yaml``); a bad file is a non-retryable
        failure naming it."""
        family = params.family or self._default_family or params.model_family
        try:
            return load_policy(family, self._policy_dir).model_dump()
        except errors.ForgeError as exc:
            raise ApplicationError(str(exc), type="CanaryPolicyInvalid", non_retryable=True) from None

    @activity.defn(name="canary_snapshot")
    async def canary_snapshot(self, params: SnapshotInput) -> Snapshot:
        """The canary's and production's counters now, summed over the gateway replicas."""
        series = [(params.canary, "canary"), (params.production, "stable")]
        total = {key: SplitCounts() for key in series}
        async with httpx.AsyncClient(timeout=self._timeout_s) as client:
            for url in self._urls:
                reply = await client.get(url)
                reply.raise_for_status()
                if len(reply.content) > MAX_METRICS_BYTES:
                    raise ApplicationError(
                        f"{url} answered over {MAX_METRICS_BYTES} bytes", non_retryable=True
                    )
                for key, counts in parse_metrics(reply.text, series).items():
                    total[key] = total[key].plus(counts)
        return Snapshot(Counts.of(total[series[0]]), Counts.of(total[series[1]]))

    @activity.defn(name="canary_look")
    async def canary_look(self, params: LookInput) -> Look:
        """One look of the analysis over the counts since the canary started."""
        policy = CanaryPolicy.model_validate(params.policy)
        canary = params.now.canary.split().minus(params.start.canary.split())
        production = params.now.production.split().minus(params.start.production.split())
        result = analyze(
            canary,
            production,
            policy,
            elapsed_s=params.elapsed_s,
            extensions=params.extensions,
            previous=params.previous,
            paused=params.paused,
        )
        return Look(
            decision=result.decision,
            reason=result.reason,
            evidence=json.dumps(result.evidence(), sort_keys=True, allow_nan=False, default=str),
            p_values=result.p_values(),
            canary_requests=canary.requests().n,
            production_requests=production.requests().n,
        )
