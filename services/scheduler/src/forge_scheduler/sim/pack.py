"""Pod packing on the Alibaba openb trace (FGD, ATC'23): pods arrive and never leave.

Pods are drawn in a seeded random order (the whole list, reshuffled on every pass) until the
arrived GPU requests reach 130 % of capacity, as in the FGD artefact. A pod that does not fit is
skipped. Reported per policy: the GPU allocation rate when the first GPU pod fails, at 100 % and
at 130 % arrived, and fragmentation (GPU capacity that the typical pod cannot use) at 100 %.

Policies: ``forge`` (fragmentation gradient: the node and GPU whose choice raises expected
fragmentation the least, measured against the pod mix seen so far), ``bestfit`` (least free GPU
left on the node) and ``random``.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FULL = 1000


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
        return self.num_gpu * (self.gpu_milli if self.num_gpu == 1 else FULL)


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
        if num_gpu and not 0 < milli <= FULL:
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


class Cluster:
    """Free CPU, memory and per-GPU milli of every node, as numpy arrays for whole-cluster scoring."""

    def __init__(self, nodes: list[PackNode]) -> None:
        self.nodes = nodes
        width = max(n.gpus for n in nodes)
        self.cpu = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        self.mem = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        self.gpu = np.full((len(nodes), width), -1, dtype=np.int64)  # -1: no such GPU
        for i, n in enumerate(nodes):
            self.gpu[i, : n.gpus] = FULL
        self.models = np.array([n.model for n in nodes])
        self.capacity = sum(n.gpus for n in nodes) * FULL
        self.allocated = 0

    def candidates(self, pod: Pod) -> np.ndarray:
        ok = (self.cpu >= pod.cpu_milli) & (self.mem >= pod.memory_mib)
        if pod.gpu_spec:
            ok &= np.isin(self.models, pod.gpu_spec)
        if pod.num_gpu == 1:
            ok &= (self.gpu >= pod.gpu_milli).any(axis=1)
        elif pod.num_gpu > 1:
            ok &= (self.gpu == FULL).sum(axis=1) >= pod.num_gpu
        return np.flatnonzero(ok)

    def gpus_for(self, node: int, pod: Pod) -> list[int]:
        """Best-fit GPUs on one node: the fullest GPU that still fits a share, whole free GPUs else."""
        row = self.gpu[node]
        if pod.num_gpu == 0:
            return []
        if pod.num_gpu == 1 and pod.gpu_milli < FULL:
            fits = np.flatnonzero(row >= pod.gpu_milli)
            return [int(fits[np.argmin(row[fits])])]
        return [int(j) for j in np.flatnonzero(row == FULL)[: pod.num_gpu]]

    def bind(self, node: int, pod: Pod, gpus: list[int]) -> None:
        self.cpu[node] -= pod.cpu_milli
        self.mem[node] -= pod.memory_mib
        share = pod.gpu_milli if pod.num_gpu == 1 else FULL
        for j in gpus:
            self.gpu[node, j] -= share
        self.allocated += pod.gpu_demand


class FragModel:
    """Expected unusable GPU milli of a node for a pod drawn from the observed mix (FGD's measure).

    For a type asking one share of ``m`` milli, GPUs with less than ``m`` free are lost to it; for
    a type asking ``k`` whole GPUs, partially used GPUs are lost, and all free GPUs are if fewer
    than ``k`` are whole. The mix is learned online from arrivals (no look-ahead).
    """

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}

    def observe(self, pod: Pod) -> None:
        if pod.num_gpu:
            key = (pod.num_gpu, pod.gpu_milli if pod.num_gpu == 1 else FULL)
            self.counts[key] = self.counts.get(key, 0) + 1

    def frag(self, gpu: np.ndarray) -> np.ndarray:
        """``gpu``: (..., GPUs) free milli (-1 = absent); returns (...) expected lost milli."""
        free = np.where(gpu > 0, gpu, 0)
        total_free = free.sum(axis=-1)
        whole = (gpu == FULL).sum(axis=-1)
        partial = np.where((gpu > 0) & (gpu < FULL), gpu, 0).sum(axis=-1)
        n = sum(self.counts.values()) or 1
        out = np.zeros(total_free.shape, dtype=np.float64)
        for (k, m), c in self.counts.items():
            if k == 1 and m < FULL:
                lost = np.where(free < m, free, 0).sum(axis=-1)
            else:
                lost = np.where(whole >= k, partial, total_free)
            out += (c / n) * lost
        return out


PACK_POLICIES = ("forge", "bestfit", "random")


def run_pack(
    nodes: list[PackNode], pods: list[Pod], policy: str, seed: int, tune: float = 1.3
) -> dict[str, float]:
    """Arrive pods until ``tune`` × capacity has been requested; returns the figures in percent."""
    rng = random.Random(seed)
    cluster = Cluster(nodes)
    model = FragModel()
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
        arrived += pod.gpu_demand
        model.observe(pod)
        cand = cluster.candidates(pod)
        if len(cand):
            node = _choose(cluster, model, pod, cand, policy, rng)
            cluster.bind(node, pod, cluster.gpus_for(node, pod))
        elif pod.num_gpu and first_failure is None:
            first_failure = cluster.allocated / cluster.capacity
        if at_full is None and arrived >= cluster.capacity:
            at_full = cluster.allocated / cluster.capacity
            frag_full = float(model.frag(cluster.gpu).sum()) / cluster.capacity
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
    cluster: Cluster, model: FragModel, pod: Pod, cand: np.ndarray, policy: str, rng: random.Random
) -> int:
    if policy == "random":
        return int(cand[rng.randrange(len(cand))])
    if pod.num_gpu == 0:
        # CPU-only pods go where they waste the least GPU: the node with the fewest free GPUs
        free = np.where(cluster.gpu[cand] > 0, cluster.gpu[cand], 0).sum(axis=1)
        return int(cand[np.lexsort((cand, -cluster.cpu[cand], free))[0]])
    if policy == "bestfit":
        free_after = np.where(cluster.gpu[cand] > 0, cluster.gpu[cand], 0).sum(axis=1) - pod.gpu_demand
        return int(cand[np.lexsort((cand, free_after))[0]])
    before = model.frag(cluster.gpu[cand])
    after_rows = cluster.gpu[cand].copy()
    if pod.num_gpu == 1 and pod.gpu_milli < FULL:
        # the same best-fit GPU ``gpus_for`` would pick, for every candidate at once
        j = np.argmin(np.where(after_rows >= pod.gpu_milli, after_rows, np.iinfo(np.int64).max), axis=1)
        after_rows[np.arange(len(cand)), j] -= pod.gpu_milli
    else:
        whole = after_rows == FULL
        after_rows[whole & (np.cumsum(whole, axis=1) <= pod.num_gpu)] -= FULL
    delta = model.frag(after_rows) - before
    free_after = np.where(after_rows > 0, after_rows, 0).sum(axis=1)
    return int(cand[np.lexsort((cand, free_after, np.round(delta, 6)))[0]])
