"""The policy's view of the scheduler's records: jobs and nodes as :mod:`forge_scheduler.policy`
values, on the policy's clock (seconds since the epoch)."""

from __future__ import annotations

import datetime as dt

from forge_scheduler.policy import Job, Node, Placement, Priority
from forge_scheduler.store import JobRow, NodeRow

INFERENCE_POOL_LABEL = "forge.ai/inference-pool"


def epoch(value: dt.datetime) -> float:
    """Seconds since the epoch of a naive UTC datetime (the policy's clock)."""
    return value.replace(tzinfo=dt.UTC).timestamp()


def policy_job(job: JobRow) -> Job:
    """The policy's view of a job record."""
    spec = job.job_spec
    return Job(
        id=job.id,
        team=job.team,
        tasks=job.replicas,
        gpus_per_task=job.gpus_per_replica,
        gpu_type=job.gpu_type,
        priority=Priority.parse(job.priority_class),
        placement=Placement(job.placement),
        submit_time=epoch(job.created_at),
        min_runtime_s=job.min_runtime_s,
        checkpointable=job.checkpointable,
        time_limit_s=spec.time_limit_s,
        workload=spec.kind.value,
    )


def policy_node(node: NodeRow) -> Node:
    """The policy's view of a node: its GPUs are taken to be of the first GPU's type."""
    gpu_type = str(node.gpus[0]["type"]) if node.gpus else ""
    return Node(
        name=node.name,
        gpus=len(node.gpus),
        gpu_type=gpu_type,
        group=node.node_group or node.name,
        rack=node.rack,
        inference_pool=node.labels.get(INFERENCE_POOL_LABEL, "").lower() == "true",
    )
