"""What a cycle decides: starts, preemptions, one reservation, and each considered entry's status.

Like Kueue's workload entries, every pending job the cycle looks at becomes an :class:`Entry`
that carries its status and the reason in words; the result keeps the reasons by job id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from forge_scheduler.policy.capacity import Slots
from forge_scheduler.policy.model import PendingJob, Team


@dataclass(frozen=True)
class Start:
    job_id: str
    slots: Slots
    borrowed: bool


@dataclass(frozen=True)
class Preemption:
    job_id: str
    for_job: str
    reason: str
    stop_by: float
    """The victim checkpoints until then (grace period), then its GPUs are released."""


@dataclass(frozen=True)
class Reservation:
    job_id: str
    nodes: tuple[str, ...]
    estimated_start: float | None


@dataclass
class CycleResult:
    starts: list[Start] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None
    order: list[str] = field(default_factory=list)
    """Pending job ids with GPUs in the order the cycle considered them."""


class EntryStatus(enum.Enum):
    """Where one pending job got to in this cycle."""

    NOMINATED = "nominated"
    """Ordered, not yet decided."""
    INADMISSIBLE = "inadmissible"
    """Unknown team or no quota left (borrowing included)."""
    STARTED = "started"
    PREEMPTING = "preempting"
    """Victims were chosen (or are already stopping) and their nodes are held for it."""
    RESERVED = "reserved"
    """Head of the line: the nodes closest to fitting it are held."""
    BLOCKED = "blocked"
    """Waits: behind a strict-FIFO head, or no room now."""


@dataclass(slots=True)
class Entry:
    """One pending job in one cycle (Kueue's workload entry): status, reason, and what admission
    found out (its team, whether it borrows quota)."""

    pending: PendingJob
    rank: int
    team: Team | None = None
    borrowed: bool = False
    status: EntryStatus = EntryStatus.NOMINATED
    reason: str = ""
