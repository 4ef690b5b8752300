"""``forge sim …``: replay traces through the policy and the baselines, time cycles, pack pods.

Every command validates all input before it creates ``--out``, then writes ``summary.json``
(the benchmark contract in load/scheduler/README.md) and its PNG plots.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Annotated

import typer

from forge_kit import clitools
from forge_scheduler.sim.cycle import CycleBench, run_cycle_bench
from forge_scheduler.sim.replay import (
    POLICIES,
    ReplayResult,
    SimSettings,
    build_cluster,
    pooled_sjf_avg_jct,
    replay,
)
from forge_scheduler.sim.trace import TraceError, TraceJob, load_trace

app = typer.Typer(help="Scheduler simulator: trace replay, cycle latency, pod packing.", no_args_is_help=True)

OutOption = Annotated[Path, typer.Option("--out", help="Output directory for summary.json and plots.")]


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _quantile(values: list[float], q: float) -> float:
    """The value at rank ``q`` (0..1) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _p95(values: list[float]) -> float:
    return _quantile(values, 0.95)


def _queue_figures(queue: list[float], waits: list[float]) -> dict[str, float]:
    """Queue time to the first start (p95, p99, max) and time pending in all, over every stretch
    in the queue (p99, max): a preempted job waits again."""
    return {
        "p95_queue_s": _p95(queue),
        "p99_queue_s": _quantile(queue, 0.99),
        "max_queue_s": max(queue, default=0.0),
        "p99_wait_s": _quantile(waits, 0.99),
        "max_wait_s": max(waits, default=0.0),
    }


def _run_one(args: tuple[list[TraceJob], str, SimSettings]) -> ReplayResult:
    trace, policy, settings = args
    return replay(trace, policy, settings)


@app.command("replay")
def replay_cmd(
    trace: Annotated[
        Path, typer.Option("--trace", help="CSV: submit_time, duration_s, num_gpus, team[, priority].")
    ],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in the simulated cluster.")],
    out: OutOption,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node.")] = 8,
    policies: Annotated[
        str, typer.Option("--policies", help="Comma-separated policies.")
    ] = "forge,fifo,fifo-backfill,multifactor",
    fmt: Annotated[str, typer.Option("--format", help="generic or philly.")] = "generic",
    limit: Annotated[int, typer.Option("--limit", help="Replay only the first N jobs (0 = all).")] = 0,
    workers: Annotated[int, typer.Option("--workers", help="Policies replayed in parallel (0 = CPUs).")] = 0,
    cycle_interval: Annotated[
        float,
        typer.Option(
            "--cycle-interval",
            help="At most one scheduling cycle per this many simulated seconds (0 = every event).",
        ),
    ] = SimSettings.cycle_interval_s,
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Replay a trace under each policy; print and write the summary and the plots."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        _fail(f"policies: unknown {unknown or names}; choose from {sorted(POLICIES)}")
    if limit < 0:
        _fail("limit: must be zero or positive")
    if not 0 <= cycle_interval < math.inf:
        _fail("cycle-interval: must be zero or a positive number of seconds")
    settings = SimSettings(gpus=gpus, gpus_per_node=gpus_per_node, cycle_interval_s=cycle_interval)
    try:
        build_cluster(settings)
        jobs = load_trace(trace, fmt)
    except TraceError as exc:
        _fail(str(exc))
    if limit:
        jobs = jobs[:limit]
    too_big = next((j for j in jobs if j.num_gpus > gpus), None)
    if too_big is not None:
        _fail(f"num_gpus: job {too_big.id} asks {too_big.num_gpus} GPUs, more than the {gpus}-GPU cluster")
    pool = workers or min(len(names), os.cpu_count() or 1)
    tasks = [(jobs, name, settings) for name in names]
    with clitools.progress(quiet) as bar:
        step = bar.add_task(f"replaying {len(jobs)} jobs", total=len(tasks))
        if pool == 1:
            results = []
            for t in tasks:
                results.append(_run_one(t))
                bar.advance(step)
        else:
            with ProcessPoolExecutor(max_workers=pool) as executor:
                futures = [executor.submit(_run_one, t) for t in tasks]
                for _ in as_completed(futures):
                    bar.advance(step)
                results = [f.result() for f in futures]
    summary: dict[str, object] = {
        "policies": {
            r.policy: {
                "avg_jct_s": sum(r.jct.values()) / len(r.jct),
                **_queue_figures(list(r.queue.values()), [r.total_wait.get(j, 0.0) for j in r.queue]),
                "queue_by_team": {
                    team: _queue_figures(
                        [q for job_id, q in r.queue.items() if r.team_of[job_id] == team],
                        [r.total_wait.get(j, 0.0) for j in r.queue if r.team_of[j] == team],
                    )
                    for team in sorted(set(r.team_of.values()))
                },
                "utilization": r.utilization,
                "makespan_s": r.makespan_s,
                "jain_index": r.jain_index,
                "fragmentation": r.fragmentation,
            }
            for r in results
        },
        "lower_bounds": {
            "mean_duration_s": sum(j.duration_s for j in jobs) / len(jobs),
            "capacity_relaxation_s": pooled_sjf_avg_jct(jobs, gpus),
        },
    }
    details = {
        r.policy: {
            "p95_queue_s_by_team": {
                team: _p95([q for job_id, q in r.queue.items() if r.team_of[job_id] == team])
                for team in sorted(set(r.team_of.values()))
            },
            "preemptions": r.preemptions,
            "cycles": r.cycles,
        }
        for r in results
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "details.json").write_text(json.dumps(details, indent=2) + "\n")
    from forge_scheduler.sim.plots import plot_replay

    plot_replay(results, out)
    typer.echo(json.dumps(summary, indent=2))


@app.command("cycle")
def cycle_cmd(
    out: OutOption,
    pending: Annotated[int, typer.Option("--pending", help="Pending jobs.")] = 10_000,
    nodes: Annotated[int, typer.Option("--nodes", help="Nodes.")] = 1_000,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node.")] = 8,
    cycles: Annotated[int, typer.Option("--cycles", help="Measured cycles.")] = 30,
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
) -> None:
    """Time one scheduling cycle over freshly drawn snapshots; p50 / p99 in ms."""
    for name, value in (
        ("pending", pending),
        ("nodes", nodes),
        ("gpus-per-node", gpus_per_node),
        ("cycles", cycles),
    ):
        if value <= 0:
            _fail(f"{name}: must be positive")
    summary = run_cycle_bench(CycleBench(pending, nodes, gpus_per_node, cycles=cycles, seed=seed))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(json.dumps(summary, indent=2))


@app.command("pack")
def pack_cmd(
    pods: Annotated[Path, typer.Option("--pods", help="openb pod list CSV.")],
    nodes: Annotated[Path, typer.Option("--nodes", help="openb node list CSV.")],
    out: OutOption,
    policies: Annotated[
        str, typer.Option("--policies", help="Comma-separated policies.")
    ] = "forge,bestfit,random",
    seed: Annotated[int, typer.Option("--seed", help="Random seed (random policy, tie order).")] = 42,
) -> None:
    """Place pods without departures until the first one fails; allocation rate and fragmentation."""
    from forge_scheduler.sim.pack import PACK_POLICIES, PackError, load_nodes, load_pods, run_pack

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in PACK_POLICIES]
    if not names or unknown:
        _fail(f"policies: unknown {unknown or names}; choose from {sorted(PACK_POLICIES)}")
    try:
        node_list = load_nodes(nodes)
        pod_list = load_pods(pods)
    except PackError as exc:
        _fail(str(exc))
    summary = {name: run_pack(node_list, pod_list, name, seed) for name in names}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(json.dumps(summary, indent=2))
