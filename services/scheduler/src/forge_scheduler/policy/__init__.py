"""The scheduling policy: a pure, deterministic library (no I/O, the clock is a parameter).

The live service and the simulator call the very same :class:`~.engine.PolicyEngine.cycle`
with a :class:`~.model.Snapshot`; what they do with the returned decisions is theirs.
"""

from forge_scheduler.policy.config import PolicyConfig
from forge_scheduler.policy.decisions import CycleResult, Entry, EntryStatus, Preemption, Reservation, Start
from forge_scheduler.policy.engine import PolicyEngine, never_fits
from forge_scheduler.policy.model import (
    Allocation,
    Job,
    Node,
    PendingJob,
    Placement,
    Priority,
    Snapshot,
    Team,
)
from forge_scheduler.policy.usage import UsageLedger

__all__ = [
    "Allocation",
    "CycleResult",
    "Entry",
    "EntryStatus",
    "Job",
    "Node",
    "PendingJob",
    "Placement",
    "PolicyConfig",
    "PolicyEngine",
    "Preemption",
    "Priority",
    "Reservation",
    "Snapshot",
    "Start",
    "Team",
    "UsageLedger",
    "never_fits",
]
