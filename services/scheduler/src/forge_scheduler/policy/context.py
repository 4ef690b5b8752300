"""The typed state one scheduling cycle works on, built once per cycle (the *nominate* step).

Every phase (:mod:`.engine`'s admit, place, backfill; :mod:`.order`; :mod:`.preemption`;
:mod:`.reservation`) reads and updates one :class:`CycleContext` instead of a dozen locals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forge_scheduler.policy.capacity import CapacityIndex, Slots
from forge_scheduler.policy.config import PolicyConfig
from forge_scheduler.policy.decisions import CycleResult, Entry
from forge_scheduler.policy.model import Allocation, Job, Node, Placement, Snapshot
from forge_scheduler.policy.quota import QuotaBook

if TYPE_CHECKING:
    from forge_scheduler.policy.preemption import VictimQueue

WHERE = {
    Placement.SAME_NODE: "one node",
    Placement.SAME_GROUP: "one node group",
    Placement.ANY: "the cluster",
}


@dataclass(slots=True, eq=False)
class CycleContext:
    """One cycle's snapshot, indexes, quota book, memos and decisions so far."""

    config: PolicyConfig
    snap: Snapshot
    now: float
    nodes: dict[str, Node]
    general: CapacityIndex
    """Free GPUs of the nodes training may use; reserved and held nodes leave it."""
    pool: CapacityIndex
    """Free GPUs of inference-pool nodes (production inference only)."""
    capacity: dict[str, int]
    """GPUs per type over all nodes."""
    held: dict[tuple[str, str], int]
    """GPUs in use per (team, GPU type) at the snapshot."""
    quota: QuotaBook
    busy: dict[str, int]
    """Jobs on each node (where jobs without GPUs go: the least busy nodes)."""
    result: CycleResult = field(default_factory=CycleResult)
    in_flight: list[Allocation] = field(default_factory=list)
    """Running jobs already being preempted: their GPUs are about to be free."""
    claimed: set[str] = field(default_factory=set)
    """Victims and in-flight preemptions already promised to an earlier entry this cycle."""
    victims: VictimQueue | None = None
    failed_searches: set[tuple[object, ...]] = field(default_factory=set)
    no_fit: set[tuple[object, ...]] = field(default_factory=set)
    started: list[tuple[Job, Slots]] = field(default_factory=list)
    reserved_free: dict[str, int] = field(default_factory=dict)
    searches: int = 0
    blocked_at: int | None = None
    """Strict FIFO: the rank of the head that did not fit."""
    higher: int = 0
    """Entries so far that hold resources ahead of later ones (preempting or reserved)."""
    fit_reasons: dict[tuple[object, ...], str] = field(default_factory=dict)

    @property
    def max_searches(self) -> int:
        return self.config.max_preemption_searches if self.config.preemption else 0

    def exhausted(self) -> bool:
        """Nothing more can start or preempt this cycle: the rest only needs its reasons."""
        return (
            self.general.total_free == 0 and self.pool.total_free == 0 and self.searches >= self.max_searches
        )

    def note(self, entry: Entry, reason: str) -> None:
        """Record ``entry``'s reason (by job id in the result)."""
        entry.reason = reason
        self.result.reasons[entry.pending.job.id] = reason

    def fit_reason(self, job: Job) -> str:
        """Why ``job`` does not fit the free GPUs, memoised per shape and free total."""
        key = (job.gpu_type, id(job.placement), job.tasks, job.gpus_per_task, self.general.total_free)
        text = self.fit_reasons.get(key)
        if text is None:
            block = self.general.largest_block(job)
            kind = f" {job.gpu_type}" if job.gpu_type else ""
            text = self.fit_reasons[key] = (
                f"waiting for {job.gpus}{kind} GPUs in {WHERE[job.placement]}; largest free block is {block}"
            )
        return text
