"""Domain model of the policy: nodes, teams with quotas, priority classes, gang jobs, allocations.

Everything here is an immutable value so that one cycle cannot change what the caller holds and
the same snapshot always gives the same decisions.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ANY_GPU_TYPE = ""


class Priority(enum.IntEnum):
    """Priority classes, highest value first in the queue; a higher class may preempt a lower one."""

    PREEMPTIBLE = 0
    NORMAL = 1
    HIGH = 2
    PRODUCTION_INFERENCE = 3

    @classmethod
    def parse(cls, name: str) -> Priority:
        """Accept the service's names (``production``, ``high``, ``normal``, ``preemptible``)."""
        key = name.strip().lower().replace("-", "_")
        aliases = {"production": "production_inference", "prod": "production_inference"}
        key = aliases.get(key, key)
        try:
            return cls[key.upper()]
        except KeyError:
            raise ValueError(f"priority: unknown class {name!r}") from None


class Placement(enum.Enum):
    """Where the tasks of one gang may land."""

    SAME_NODE = "same_node"
    SAME_GROUP = "same_group"
    ANY = "any"


@dataclass(frozen=True)
class Node:
    """A machine: its GPUs are all of one type; ``group`` is its NVLink / network domain."""

    name: str
    gpus: int
    gpu_type: str = "H100"
    group: str = "g0"
    rack: str = ""
    inference_pool: bool = False
    """Reserved for production inference: training never lands here."""


@dataclass(frozen=True)
class Team:
    """A team's guaranteed GPUs per type, how much more it may borrow, and its fair-share weight."""

    name: str
    guaranteed: Mapping[str, int] = field(default_factory=dict)
    borrow_limit: int | None = None
    """Extra GPUs (all types) the team may borrow from its cohort; ``None`` = unlimited."""
    weight: float = 1.0
    cohort: str = "default"

    def guarantee(self, gpu_type: str) -> int:
        if gpu_type == ANY_GPU_TYPE:
            return sum(self.guaranteed.values())
        return self.guaranteed.get(gpu_type, 0)


@dataclass(frozen=True)
class Job:
    """A gang of ``tasks`` × ``gpus_per_task``; all tasks start together or none does."""

    id: str
    team: str
    tasks: int = 1
    gpus_per_task: int = 1
    gpu_type: str = ANY_GPU_TYPE
    priority: Priority = Priority.NORMAL
    placement: Placement = Placement.ANY
    submit_time: float = 0.0
    min_runtime_s: float = 0.0
    """Never preempted before it has run this long (it would lose its warm-up)."""
    checkpointable: bool = True
    time_limit_s: float | None = None
    """The user's declared limit; only backfill onto reserved nodes uses it. ``None`` = unknown."""
    workload: str = "training"

    @property
    def gpus(self) -> int:
        return self.tasks * self.gpus_per_task


@dataclass(frozen=True)
class PendingJob:
    """A job waiting to run, with what it has already consumed in earlier runs (GPU-seconds)."""

    job: Job
    attained_gpu_s: float = 0.0
    queued_since: float | None = None
    """When it last entered the queue (submit or preemption); ``None`` = ``job.submit_time``."""

    @property
    def waiting_since(self) -> float:
        return self.job.submit_time if self.queued_since is None else self.queued_since


@dataclass(frozen=True)
class Allocation:
    """A running job and where its tasks are: ``slots`` = ((node, gpus), …), one entry per task."""

    job: Job
    slots: tuple[tuple[str, int], ...]
    start_time: float
    last_checkpoint_time: float | None = None
    attained_gpu_s: float = 0.0
    """GPU-seconds consumed before this run started."""
    borrowed: bool = False
    preempting: bool = False
    """A preemption was already ordered; its GPUs are about to be free."""
    checkpoint_interval_s: float | None = None
    """Periodic checkpoints since ``start_time``, when ``last_checkpoint_time`` is not reported."""

    def last_checkpoint(self, now: float) -> float:
        """When the job last checkpointed (its start if it never did): the work since is at risk."""
        if self.last_checkpoint_time is not None:
            return self.last_checkpoint_time
        if self.checkpoint_interval_s and self.job.checkpointable:
            elapsed = max(0.0, now - self.start_time)
            return self.start_time + (elapsed // self.checkpoint_interval_s) * self.checkpoint_interval_s
        return self.start_time

    def attained(self, now: float) -> float:
        return self.attained_gpu_s + self.job.gpus * max(0.0, now - self.start_time)


@dataclass(frozen=True)
class Snapshot:
    """Everything one cycle reads. ``usage`` is each team's decayed GPU-seconds (see UsageLedger)."""

    nodes: Sequence[Node]
    teams: Mapping[str, Team]
    pending: Sequence[PendingJob]
    running: Sequence[Allocation]
    usage: Mapping[str, float] = field(default_factory=dict)
