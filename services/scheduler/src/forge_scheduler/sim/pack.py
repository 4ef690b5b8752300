"""Pod packing on the Alibaba openb trace (FGD, ATC'23): pods arrive and never leave.

Pods are drawn in a seeded random order (the whole list, reshuffled on every pass) until the
arrived GPU requests reach 130 % of capacity, as in the FGD artefact. A pod that does not fit is
skipped. Reported per policy: the GPU allocation rate when the first GPU pod fails, at 100 % and
at 130 % arrived, and fragmentation at 100 % arrived: FGD's measure (free GPU capacity that a pod
drawn from the mix seen so far could not use, for lack of GPU, CPU or memory), weighted by GPU
demand, in % of all GPUs.

Policies: ``forge`` (fragmentation gradient descent over CPU, memory and per-GPU shares, from
:mod:`forge_scheduler.policy.fragmentation`), ``bestfit`` (least free GPU left on the node) and
``random``. This module only reads the openb CSVs and drives the arrivals.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forge_scheduler.policy.fragmentation import (
    FULL_GPU,
    GpuShareCluster,
    NodeSpec,
    TaskShape,
    WorkloadMix,
)


class PackError(ValueError):
    """Bad node or pod list; the message names the row and field."""


@dataclass(frozen=True)
class PackNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class Pod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]

    @property
    def gpu_demand(self) -> int:
        return self.num_gpu * (self.gpu_milli if self.num_gpu == 1 else FULL_GPU)


def _int(row: dict[str, str], field: str, row_no: int, minimum: int = 0) -> int:
    try:
        value = int(float(row[field]))
    except (KeyError, TypeError, ValueError):
        raise PackError(f"row {row_no}: {field}: not a whole number: {row.get(field)!r}") from None
    if value < minimum:
        raise PackError(f"row {row_no}: {field}: must be at least {minimum}, got {value}")
    return value


def _rows(path: Path, required: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in required if c not in (reader.fieldnames or [])]
            if missing:
                raise PackError(f"{path.name}: missing column(s) {', '.join(missing)}")
            rows = list(reader)
    except OSError as exc:
        raise PackError(f"{path}: cannot read: {exc.strerror}") from None
    if not rows:
        raise PackError(f"{path.name}: no rows")
    return rows


def load_nodes(path: Path) -> list[PackNode]:
    rows = _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model"))
    nodes = [
        PackNode(
            r["sn"],
            _int(r, "cpu_milli", i),
            _int(r, "memory_mib", i),
            _int(r, "gpu", i),
            (r["model"] or "").strip(),
        )
        for i, r in enumerate(rows, start=2)
    ]
    if not any(n.gpus for n in nodes):
        raise PackError(f"{path.name}: gpu: no node has GPUs")
    return nodes


def load_pods(path: Path) -> list[Pod]:
    rows = _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"))
    pods = []
    for i, r in enumerate(rows, start=2):
        num_gpu = _int(r, "num_gpu", i)
        milli = _int(r, "gpu_milli", i)
        if num_gpu and not 0 < milli <= FULL_GPU:
            raise PackError(f"row {i}: gpu_milli: must be in 1..1000 for a GPU pod, got {milli}")
        spec = tuple(s for s in (r.get("gpu_spec") or "").split("|") if s)
        pods.append(
            Pod(
                r["name"],
                _int(r, "cpu_milli", i),
                _int(r, "memory_mib", i),
                num_gpu,
                milli if num_gpu else 0,
                spec,
            )
        )
    return pods


PACK_POLICIES = ("forge", "bestfit", "random")


def to_spec(node: PackNode) -> NodeSpec:
    return NodeSpec(node.name, node.cpu_milli, node.memory_mib, node.gpus, node.model)


def to_task(pod: Pod) -> TaskShape:
    return TaskShape(
        pod.cpu_milli,
        pod.memory_mib,
        pod.num_gpu,
        pod.gpu_milli if pod.num_gpu == 1 else FULL_GPU,
        pod.gpu_spec,
    )


def run_pack(
    nodes: list[PackNode], pods: list[Pod], policy: str, seed: int, tune: float = 1.3
) -> dict[str, float]:
    """Arrive pods until ``tune`` × capacity has been requested; returns the figures in percent."""
    if policy not in PACK_POLICIES:
        raise PackError(f"policy: unknown {policy!r}; choose from {', '.join(PACK_POLICIES)}")
    rng = random.Random(seed)
    cluster = GpuShareCluster([to_spec(n) for n in nodes])
    tasks = {pod.name: to_task(pod) for pod in pods}
    mix = WorkloadMix()
    arrived = 0
    first_failure: float | None = None
    at_full: float | None = None
    frag_full: float | None = None
    order: list[Pod] = []
    while arrived < tune * cluster.capacity:
        if not order:
            order = list(pods)
            rng.shuffle(order)
        pod = order.pop()
        task = tasks[pod.name]
        arrived += task.gpu_demand
        mix.observe(task)
        cand = cluster.candidates(task)
        if len(cand):
            node, gpus = _choose(cluster, mix, task, cand, policy, rng)
            cluster.bind(node, task, gpus)
        elif task.gpus and first_failure is None:
            first_failure = cluster.allocated / cluster.capacity
        if at_full is None and arrived >= cluster.capacity:
            at_full = cluster.allocated / cluster.capacity
            frag_full = float(cluster.fragmentation(mix).sum()) / cluster.capacity
    end = cluster.allocated / cluster.capacity
    return {
        "allocation_rate_at_first_failure": round(
            100 * (first_failure if first_failure is not None else end), 2
        ),
        "fragmentation_at_full_arrival": round(100 * (frag_full or 0.0), 2),
        "allocation_rate_at_full_arrival": round(100 * (at_full or end), 2),
        f"allocation_rate_at_{round(tune * 100)}_arrival": round(100 * end, 2),
    }


def _choose(
    cluster: GpuShareCluster,
    mix: WorkloadMix,
    task: TaskShape,
    cand: np.ndarray,
    policy: str,
    rng: random.Random,
) -> tuple[int, list[int]]:
    if policy == "random":
        node = int(cand[rng.randrange(len(cand))])
        return node, cluster.best_fit_gpus(node, task)
    if policy == "forge":
        return cluster.place_fgd(task, mix, cand)
    # best fit: least free GPU left on the node; CPU-only pods where they strand the least GPU
    free = cluster.free_gpu(cand)
    if task.gpus == 0:
        node = int(cand[np.lexsort((cand, -cluster.cpu[cand], free))[0]])
    else:
        node = int(cand[np.lexsort((cand, free - task.gpu_demand))[0]])
    return node, cluster.best_fit_gpus(node, task)
