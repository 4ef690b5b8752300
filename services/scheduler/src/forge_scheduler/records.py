"""What the scheduler's domain takes and returns: plain dataclasses, no transport types.

:mod:`forge_scheduler.api` translates between these and the gRPC messages.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from forge_scheduler.store import QuotaRow


@dataclass(frozen=True)
class QuotaSpec:
    """A team's quota for one GPU type."""

    gpu_type: str
    guaranteed_gpus: int = 0
    borrow_limit: int = 0
    weight: float = 0.0
    """0 = the default weight, 1."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    type: str
    memory_mb: int = 0
    uuid: str = ""
    pci_bus_id: str = ""
    nvlink_group: int = 0
    pcie_group: int = 0


@dataclass(frozen=True)
class NodeRegistration:
    """What an agent announces when its session opens."""

    node_name: str
    gpus: tuple[GpuInfo, ...] = ()
    node_group: str = ""
    rack: str = ""
    nvlink_domain: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    running_job_ids: tuple[str, ...] = ()
    job_isolation: dict[str, Any] | None = None
    """The node's isolation capabilities as JSON, where it reported them."""


@dataclass(frozen=True)
class ReplicaReport:
    """An agent's report about one job's replica on its node."""

    job_id: str
    state: int
    """A ``forge.common.v1.JobState`` number (:class:`forge_kit.jobstate.JobState`)."""
    message: str = ""
    last_checkpoint_at: dt.datetime | None = None
    """Naive UTC."""
    endpoint: str = ""
    """A serving replica's URL, with RUNNING."""


@dataclass(frozen=True)
class TeamView:
    """A team with its quotas, as returned to callers."""

    name: str
    display_name: str
    created_at: dt.datetime
    quotas: tuple[QuotaRow, ...]

    cohort: str = "default"


@dataclass(frozen=True)
class QueueStats:
    """Queue figures of one team."""

    team: str
    pending_jobs: int = 0
    running_jobs: int = 0
    gpus_in_use: int = 0
    queue_time_p50_s: float = 0.0
    queue_time_p95_s: float = 0.0
    guaranteed_gpus: int = 0
    borrowed_gpus: int = 0
    fair_share_gpus: float = 0.0
    share_ratio: float = 0.0
    decayed_usage_gpu_hours: float = 0.0


@dataclass
class ClusterView:
    """Figures of the last scheduling cycle (kept in memory; recomputed every cycle)."""

    total_gpus: int = 0
    allocated_gpus: int = 0
    utilization: float = 0.0
    fragmented_gpus: int = 0
    jain_index: float = 1.0
    share_deviation_gpus: float = 0.0
    ready_nodes: int = 0
    pending_jobs: int = 0
    running_jobs: int = 0
    largest_free_block: int = 0
    last_cycle_ms: float = 0.0
    last_cycle_at: dt.datetime | None = None
    fair_shares: dict[str, float] = field(default_factory=dict)
    queue_positions: dict[str, int] = field(default_factory=dict)
