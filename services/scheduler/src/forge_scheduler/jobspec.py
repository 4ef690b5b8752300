"""What a job asks for, as the scheduler's domain takes and stores it: :class:`JobSpec`, a frozen
value built once at the API edge (:func:`forge_scheduler.messages.spec_from_proto`) from the
``forge.scheduler.v1.JobSpec`` message, kept in the job record as JSON (:meth:`JobSpec.to_json`),
and turned back into the message only when a job is answered or sent to an agent.

The fields are those of the message, typed: the kind and placement are enums, durations are
seconds, labels and the environment are plain mappings. Unset values keep their meaning (a kind
``unspecified``, a placement None that :attr:`JobSpec.effective_placement` resolves, replicas 0
meaning 1), so a job is answered exactly as it was submitted.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from forge_scheduler.policy import Placement


class JobKind(enum.StrEnum):
    """The kind of work (``JobKind`` of the API, without its prefix)."""

    UNSPECIFIED = "unspecified"
    TRAINING = "training"
    FINE_TUNE = "fine_tune"
    INFERENCE = "inference"
    EVAL = "eval"
    INTERACTIVE = "interactive"


#: Kinds that are gangs of GPU tasks; other kinds (unspecified, eval, interactive) may be CPU-only.
GPU_KINDS = frozenset({JobKind.TRAINING, JobKind.FINE_TUNE, JobKind.INFERENCE})


@dataclass(frozen=True)
class JobRouting:
    """Typed routing hints copied onto every ``JobStateChanged`` of the job."""

    workflow_id: str = ""
    skip_auto_eval: bool = False


@dataclass(frozen=True)
class JobSpec:
    """A submitted job's request. See the module docstring."""

    name: str
    team: str
    priority_class: str
    command: tuple[str, ...]
    kind: JobKind = JobKind.UNSPECIFIED
    gpu_type: str = ""
    gpus_per_replica: int = 0
    cpu_millis: int = 0
    memory_mb: int = 0
    replicas: int = 0
    """As submitted: 0 means 1 (:attr:`tasks`)."""
    same_node_group: bool = False
    placement: Placement | None = None
    """None: unset, :attr:`effective_placement` follows ``same_node_group``."""
    env: Mapping[str, str] = field(default_factory=dict)
    image: str = ""
    max_runtime_s: int = 0
    """0: no limit."""
    preemptible: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    min_runtime_s: int = 0
    checkpointable: bool = False
    checkpoint_interval_s: int = 0
    """0: unknown."""
    routing: JobRouting | None = None

    @property
    def tasks(self) -> int:
        """The gang size."""
        return max(1, self.replicas)

    @property
    def effective_placement(self) -> Placement:
        if self.placement is not None:
            return self.placement
        return Placement.SAME_GROUP if self.same_node_group else Placement.ANY

    @property
    def time_limit_s(self) -> float | None:
        return float(self.max_runtime_s) or None

    def to_json(self) -> dict[str, Any]:
        """The record as the job row stores it (JSON types only)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, JobRouting):
                value = {"workflow_id": value.workflow_id, "skip_auto_eval": value.skip_auto_eval}
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """The record :meth:`to_json` wrote."""
        values = dict(data)
        values["command"] = tuple(values.get("command", ()))
        values["kind"] = JobKind(values.get("kind", JobKind.UNSPECIFIED.value))
        placement = values.get("placement")
        values["placement"] = None if placement is None else Placement(placement)
        routing = values.get("routing")
        values["routing"] = None if routing is None else JobRouting(**routing)
        return cls(**values)
