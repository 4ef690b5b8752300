"""Test-data builders: ``make_job(team="research").gpus(8, "H100").replicas(2).build()``."""

from __future__ import annotations

from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2


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

    def label(self, key: str, value: str) -> JobBuilder:
        self._spec.labels[key] = value
        return self

    def build(self) -> scheduler_pb2.JobSpec:
        spec = scheduler_pb2.JobSpec()
        spec.CopyFrom(self._spec)
        return spec


def make_job(name: str = "train-llama", team: str = "research") -> JobBuilder:
    return JobBuilder(name, team)
