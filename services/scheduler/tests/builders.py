"""Test-data builders: ``make_job(team="research").gpus(8, "H100").replicas(2).build()``."""

from __future__ import annotations

from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_scheduler.jobspec import JobSpec
from forge_scheduler.messages import spec_from_proto


class JobBuilder:
    def __init__(self, name: str, team: str) -> None:
        self._spec = scheduler_pb2.JobSpec(
            name=name, team=team, priority_class="normal", command=["python", "-m", "train"]
        )

    def gpus(self, count: int, gpu_type: str = "H100") -> JobBuilder:
        self._spec.resources.CopyFrom(common_pb2.ResourceRequest(gpu_count=count, gpu_type=gpu_type))
        return self

    def replicas(self, n: int) -> JobBuilder:
        self._spec.replicas = n
        return self

    def priority(self, priority_class: str) -> JobBuilder:
        self._spec.priority_class = priority_class
        return self

    def same_node_group(self) -> JobBuilder:
        self._spec.same_node_group = True
        return self

    def label(self, key: str, value: str) -> JobBuilder:
        self._spec.labels[key] = value
        return self

    def build(self) -> scheduler_pb2.JobSpec:
        """The API's message (for tests through gRPC)."""
        spec = scheduler_pb2.JobSpec()
        spec.CopyFrom(self._spec)
        return spec

    def record(self) -> JobSpec:
        """The domain's record, as the API builds it from :meth:`build` (for tests of the service)."""
        return spec_from_proto(self.build())


def make_job(name: str = "train-llama", team: str = "research") -> JobBuilder:
    return JobBuilder(name, team)


# ---------------------------------------------------------------------------- policy builders
# ``make_pjob("big", team="research").gpus(8).same_node_group().build()`` → forge_scheduler.policy.Job

from forge_scheduler.policy.model import (  # noqa: E402
    Allocation,
    Job,
    Node,
    PendingJob,
    Placement,
    Priority,
    Team,
)


class PolicyJobBuilder:
    def __init__(self, job_id: str, team: str) -> None:
        self._job_id = job_id
        self._team = team
        self._tasks = 1
        self._per = 1
        self._gpu_type = "H100"
        self._priority = Priority.NORMAL
        self._placement = Placement.SAME_NODE
        self._submit = 0.0
        self._min_runtime = 0.0
        self._limit: float | None = None
        self._checkpointable = True

    def gpus(self, per_task: int, gpu_type: str = "H100") -> PolicyJobBuilder:
        self._per, self._gpu_type = per_task, gpu_type
        return self

    def tasks(self, n: int) -> PolicyJobBuilder:
        self._tasks = n
        if n > 1 and self._placement is Placement.SAME_NODE:
            self._placement = Placement.ANY
        return self

    def same_node(self) -> PolicyJobBuilder:
        self._placement = Placement.SAME_NODE
        return self

    def same_node_group(self) -> PolicyJobBuilder:
        self._placement = Placement.SAME_GROUP
        return self

    def anywhere(self) -> PolicyJobBuilder:
        self._placement = Placement.ANY
        return self

    def priority(self, name: str) -> PolicyJobBuilder:
        self._priority = Priority.parse(name)
        return self

    def submitted(self, at: float) -> PolicyJobBuilder:
        self._submit = at
        return self

    def min_runtime(self, seconds: float) -> PolicyJobBuilder:
        self._min_runtime = seconds
        return self

    def limit(self, seconds: float) -> PolicyJobBuilder:
        self._limit = seconds
        return self

    def no_checkpoint(self) -> PolicyJobBuilder:
        self._checkpointable = False
        return self

    def build(self) -> Job:
        return Job(
            self._job_id,
            self._team,
            self._tasks,
            self._per,
            self._gpu_type,
            self._priority,
            self._placement,
            self._submit,
            self._min_runtime,
            self._checkpointable,
            self._limit,
        )

    def pending(self, attained_gpu_s: float = 0.0, queued_since: float | None = None) -> PendingJob:
        return PendingJob(self.build(), attained_gpu_s, queued_since)

    def running(
        self,
        on: list[tuple[str, int]],
        start: float = 0.0,
        last_checkpoint: float | None = None,
        borrowed: bool = False,
        attained_gpu_s: float = 0.0,
    ) -> Allocation:
        return Allocation(self.build(), tuple(on), start, last_checkpoint, attained_gpu_s, borrowed)


def make_pjob(job_id: str = "job", team: str = "research") -> PolicyJobBuilder:
    return PolicyJobBuilder(job_id, team)


def make_cluster(
    nodes: int = 2, gpus: int = 8, groups: int = 1, gpu_type: str = "H100", inference_pool: int = 0
) -> list[Node]:
    """``nodes`` nodes split evenly over ``groups`` groups; the last ``inference_pool`` are reserved."""
    per_group = max(1, nodes // groups)
    return [
        Node(f"n{i}", gpus, gpu_type, group=f"g{i // per_group}", inference_pool=i >= nodes - inference_pool)
        for i in range(nodes)
    ]


def make_teams(
    *names: str, guaranteed: int = 8, gpu_type: str = "H100", borrow_limit: int | None = None
) -> dict[str, Team]:
    return {n: Team(n, {gpu_type: guaranteed}, borrow_limit) for n in names}
