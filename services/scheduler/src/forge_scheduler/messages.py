"""The job spec between the API's message and the domain's record: the one place that reads and
writes ``forge.scheduler.v1.JobSpec`` (see :mod:`forge_scheduler.jobspec`)."""

from __future__ import annotations

from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_kit import errors
from forge_scheduler.jobspec import JobKind, JobRouting, JobSpec
from forge_scheduler.policy import Placement

_KINDS = {
    scheduler_pb2.JOB_KIND_UNSPECIFIED: JobKind.UNSPECIFIED,
    scheduler_pb2.JOB_KIND_TRAINING: JobKind.TRAINING,
    scheduler_pb2.JOB_KIND_FINE_TUNE: JobKind.FINE_TUNE,
    scheduler_pb2.JOB_KIND_INFERENCE: JobKind.INFERENCE,
    scheduler_pb2.JOB_KIND_EVAL: JobKind.EVAL,
    scheduler_pb2.JOB_KIND_INTERACTIVE: JobKind.INTERACTIVE,
}
_PLACEMENTS = {
    scheduler_pb2.PLACEMENT_UNSPECIFIED: None,
    scheduler_pb2.PLACEMENT_ANY: Placement.ANY,
    scheduler_pb2.PLACEMENT_SAME_NODE: Placement.SAME_NODE,
    scheduler_pb2.PLACEMENT_SAME_NODE_GROUP: Placement.SAME_GROUP,
}


def spec_from_proto(spec: scheduler_pb2.JobSpec) -> JobSpec:
    """The domain's record of a submitted spec; an enum value the API does not define is refused,
    naming the field."""
    if spec.kind not in _KINDS:
        raise errors.ValidationError("spec.kind", f"unknown kind {spec.kind}")
    if spec.placement not in _PLACEMENTS:
        raise errors.ValidationError("spec.placement", f"unknown placement {spec.placement}")
    return JobSpec(
        name=spec.name,
        team=spec.team,
        priority_class=spec.priority_class,
        command=tuple(spec.command),
        kind=_KINDS[spec.kind],
        gpu_type=spec.resources.gpu_type,
        gpus_per_replica=spec.resources.gpu_count,
        cpu_millis=spec.resources.cpu_millis,
        memory_mb=spec.resources.memory_mb,
        replicas=spec.replicas,
        same_node_group=spec.same_node_group,
        placement=_PLACEMENTS[spec.placement],
        env=dict(spec.env),
        image=spec.image,
        max_runtime_s=spec.max_runtime_seconds,
        preemptible=spec.preemptible,
        labels=dict(spec.labels),
        min_runtime_s=spec.min_runtime_seconds,
        checkpointable=spec.checkpointable,
        checkpoint_interval_s=spec.checkpoint_interval_seconds,
        routing=routing_from_proto(spec.routing) if spec.HasField("routing") else None,
    )


def spec_to_proto(spec: JobSpec) -> scheduler_pb2.JobSpec:
    """The message of a record: what :func:`spec_from_proto` read, field for field."""
    kinds = {kind: number for number, kind in _KINDS.items()}
    placements = {placement: number for number, placement in _PLACEMENTS.items()}
    resources = common_pb2.ResourceRequest(
        gpu_count=spec.gpus_per_replica,
        gpu_type=spec.gpu_type,
        cpu_millis=spec.cpu_millis,
        memory_mb=spec.memory_mb,
    )
    return scheduler_pb2.JobSpec(
        name=spec.name,
        team=spec.team,
        priority_class=spec.priority_class,
        kind=kinds[spec.kind],  # type: ignore[arg-type]
        resources=resources if resources.ListFields() else None,
        replicas=spec.replicas,
        same_node_group=spec.same_node_group,
        command=list(spec.command),
        env=dict(spec.env),
        image=spec.image,
        max_runtime_seconds=spec.max_runtime_s,
        preemptible=spec.preemptible,
        labels=dict(spec.labels),
        placement=placements[spec.placement],  # type: ignore[arg-type]
        min_runtime_seconds=spec.min_runtime_s,
        checkpointable=spec.checkpointable,
        checkpoint_interval_seconds=spec.checkpoint_interval_s,
        routing=routing_to_proto(spec.routing) if spec.routing is not None else None,
    )


def routing_from_proto(routing: common_pb2.JobRouting) -> JobRouting:
    return JobRouting(workflow_id=routing.workflow_id, skip_auto_eval=routing.skip_auto_eval)


def routing_to_proto(routing: JobRouting) -> common_pb2.JobRouting:
    return common_pb2.JobRouting(workflow_id=routing.workflow_id, skip_auto_eval=routing.skip_auto_eval)
