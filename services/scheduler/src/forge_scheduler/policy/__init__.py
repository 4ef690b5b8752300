"""The scheduling policy: a pure, deterministic library (no I/O, the clock is a parameter).

The live service and the simulator call the very same :class:`~.engine.PolicyEngine.cycle`
with a :class:`~.model.Snapshot`; what they do with the returned decisions is theirs.
"""

from forge_scheduler.policy.engine import (
    CycleResult,
    PolicyConfig,
    PolicyEngine,
    Preemption,
    Start,
    never_fits,
)
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
    "Job",
    "Node",
    "PendingJob",
    "Placement",
    "PolicyConfig",
    "PolicyEngine",
    "Preemption",
    "Priority",
    "Snapshot",
    "Start",
    "Team",
    "UsageLedger",
    "never_fits",
]
