"""Cycle-latency benchmark: one scheduling cycle with many pending jobs on a large cluster.

The cluster is kept about 90 % busy (where a cycle does the most work: most jobs do not fit and
the engine must say why, look for victims and make a reservation), with a random mix of shapes,
priorities and teams, redrawn for every measured cycle.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from forge_scheduler.gcpause import collector_paused
from forge_scheduler.policy.engine import PolicyConfig, PolicyEngine
from forge_scheduler.policy.model import (
    Allocation,
    Job,
    Node,
    PendingJob,
    Placement,
    Priority,
    Snapshot,
    Team,
)


@dataclass(frozen=True)
class CycleBench:
    pending: int = 10_000
    nodes: int = 1_000
    gpus_per_node: int = 8
    nodes_per_group: int = 32
    teams: int = 20
    busy_fraction: float = 0.9
    cycles: int = 30
    seed: int = 0


def build_snapshot(bench: CycleBench, rng: random.Random) -> Snapshot:
    nodes = [
        Node(f"n{i:05d}", bench.gpus_per_node, "H100", group=f"g{i // bench.nodes_per_group:03d}")
        for i in range(bench.nodes)
    ]
    total = bench.nodes * bench.gpus_per_node
    team_names = [f"team{i:02d}" for i in range(bench.teams)]
    teams = {
        n: Team(n, {"H100": total // bench.teams}, None, 1.0 + (i % 3)) for i, n in enumerate(team_names)
    }
    running: list[Allocation] = []
    target = int(total * bench.busy_fraction)
    busy = 0
    for node in nodes:
        left = node.gpus
        while left > 0 and busy < target:
            g = min(left, rng.choice([1, 1, 2, 4, 8]))
            job = Job(
                f"r{len(running):06d}",
                rng.choice(team_names),
                1,
                g,
                "H100",
                rng.choice([Priority.PREEMPTIBLE, Priority.NORMAL, Priority.NORMAL, Priority.HIGH]),
                Placement.SAME_NODE,
                rng.uniform(0, 5000),
                min_runtime_s=rng.choice([0.0, 600.0]),
            )
            running.append(
                Allocation(
                    job,
                    ((node.name, g),),
                    rng.uniform(0, 9000),
                    None,
                    rng.uniform(0, 5e5),
                    False,
                    False,
                    1800.0,
                )
            )
            left -= g
            busy += g
    pending: list[PendingJob] = []
    for i in range(bench.pending):
        per = rng.choice([1, 1, 1, 2, 4, 8])
        tasks = rng.choice([1, 1, 1, 1, 2, 4]) if per == 8 else 1
        placement = Placement.SAME_NODE if tasks == 1 else rng.choice([Placement.SAME_GROUP, Placement.ANY])
        job = Job(
            f"p{i:06d}",
            rng.choice(team_names),
            tasks,
            per,
            "H100",
            rng.choice(
                [Priority.PREEMPTIBLE, Priority.NORMAL, Priority.NORMAL, Priority.NORMAL, Priority.HIGH]
            ),
            placement,
            rng.uniform(0, 10_000),
        )
        pending.append(PendingJob(job, rng.choice([0.0, 0.0, 1e4, 1e5, 1e6])))
    usage = {n: rng.uniform(0, 1e7) for n in team_names}
    return Snapshot(nodes, teams, pending, running, usage)


def run_cycle_bench(
    bench: CycleBench,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> dict[str, object]:
    """Cycle time in ms over ``bench.cycles`` freshly drawn snapshots: wall (``cycle_ms``, the
    contract) and this process's CPU time (``cycle_cpu_ms``, what the cycle costs when the
    machine is busy with other work).

    Each cycle runs with the cyclic garbage collector paused, as the service's scheduling loop
    runs it (``forge_scheduler.gcpause``): otherwise a full collection of the benchmark's own heap
    lands inside some cycle every few cycles and the p99 measures that instead of the policy.
    """
    rng = random.Random(bench.seed)
    engine = PolicyEngine(PolicyConfig.forge())
    times: list[float] = []
    cpu_times: list[float] = []
    starts = preemptions = 0
    for _ in range(bench.cycles):
        snap = build_snapshot(bench, rng)
        with collector_paused():
            begin, cpu_begin = clock(), cpu_clock()
            result = engine.cycle(snap, 10_000.0)
            times.append((clock() - begin) * 1000.0)
            cpu_times.append((cpu_clock() - cpu_begin) * 1000.0)
        starts += len(result.starts)
        preemptions += len(result.preemptions)

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "cycle_ms": {"p50": round(pct(times, 0.5), 3), "p99": round(pct(times, 0.99), 3)},
        "cycle_cpu_ms": {"p50": round(pct(cpu_times, 0.5), 3), "p99": round(pct(cpu_times, 0.99), 3)},
        "cycles": bench.cycles,
        "pending": bench.pending,
        "nodes": bench.nodes,
        "gpus_per_node": bench.gpus_per_node,
        "mean_starts_per_cycle": starts / bench.cycles,
        "mean_preemptions_per_cycle": preemptions / bench.cycles,
    }
