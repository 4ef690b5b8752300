"""A job's state as one enum, from the wire to workflows: :class:`JobState`.

The protos carry ``forge.common.v1.JobState`` numbers; workflows, events and CLIs speak the short
names (``"SUCCEEDED"``). ``JobState`` is both: a ``StrEnum`` whose values are the short names (so
it serialises, compares and prints as the names stored workflow histories already hold) with
:meth:`JobState.from_proto` / :attr:`JobState.proto` for the numbers. No string surgery on
``JOB_STATE_*`` names anywhere else.
"""

from __future__ import annotations

import enum

from forge.common.v1 import common_pb2


class JobState(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def proto(self) -> common_pb2.JobState.ValueType:
        """The ``forge.common.v1.JobState`` number."""
        return common_pb2.JobState.Value(f"JOB_STATE_{self.value}")

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @classmethod
    def from_proto(cls, number: int) -> JobState:
        """The state of a ``forge.common.v1.JobState`` number; ``ValueError`` for an unknown one."""
        try:
            return _BY_NUMBER[number]
        except KeyError:
            raise ValueError(f"job state: unknown number {number}") from None


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
_BY_NUMBER: dict[int, JobState] = {int(state.proto): state for state in JobState}
