"""Job states as the scheduler stores them (``forge.common.v1.JobState`` numbers, from
:class:`forge_kit.jobstate.JobState`), the sets its lifecycle is written in, and node states."""

from __future__ import annotations

from forge.scheduler.v1 import scheduler_pb2

from forge_kit.jobstate import JobState

UNSPECIFIED = JobState.UNSPECIFIED.proto
PENDING, SCHEDULED, RUNNING = JobState.PENDING.proto, JobState.SCHEDULED.proto, JobState.RUNNING.proto
SUCCEEDED, FAILED, CANCELLED, PREEMPTED = (
    JobState.SUCCEEDED.proto,
    JobState.FAILED.proto,
    JobState.CANCELLED.proto,
    JobState.PREEMPTED.proto,
)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
ACTIVE = frozenset({SCHEDULED, RUNNING})
#: States a replica reports when its process has ended.
REPLICA_ENDED = frozenset({SUCCEEDED, FAILED, CANCELLED, PREEMPTED})

#: Node states as stored (``forge.scheduler.v1.NodeState`` numbers).
NODE_READY = scheduler_pb2.NodeState.NODE_STATE_READY
NODE_NOT_READY = scheduler_pb2.NodeState.NODE_STATE_NOT_READY
