"""A job's routing hints as a typed value: :class:`Routing` (``forge.common.v1.JobRouting``).

Which workflow waits for a job's state changes, and whether its success triggers the automatic
evaluation, travel as typed fields of the job spec and of every ``JobStateChanged``. Jobs stored
before those fields existed carry them as the free-text labels ``workflow_id`` and ``auto_eval``;
:meth:`Routing.read` falls back to those, so old jobs keep routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from forge.common.v1 import common_pb2

WORKFLOW_ID_LABEL = "workflow_id"
"""The label older jobs carried their workflow id in."""
AUTO_EVAL_LABEL = "auto_eval"
"""The label older jobs carried ``"false"`` in to skip the automatic evaluation."""


@dataclass(frozen=True)
class Routing:
    workflow_id: str = ""
    """The workflow that submitted the job and waits for its events; empty: none."""
    auto_eval: bool = True
    """Whether the orchestrator evaluates the job's checkpoint when it succeeds."""

    def to_proto(self) -> common_pb2.JobRouting:
        return common_pb2.JobRouting(workflow_id=self.workflow_id, skip_auto_eval=not self.auto_eval)

    @classmethod
    def read(cls, routing: common_pb2.JobRouting | None, labels: Mapping[str, str]) -> Routing:
        """The typed hints, each falling back to its legacy label where the typed field is unset."""
        typed = routing or common_pb2.JobRouting()
        return cls(
            workflow_id=typed.workflow_id or labels.get(WORKFLOW_ID_LABEL, ""),
            auto_eval=not typed.skip_auto_eval and labels.get(AUTO_EVAL_LABEL, "true").lower() != "false",
        )
