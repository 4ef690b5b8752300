"""Replay a job trace through a policy under a simulated clock.

Durations are the simulator's ground truth: they decide when a job finishes, and they are given to
the baselines that model Slurm's user time limits (FIFO + backfill, multifactor) as a perfect
estimate, which flatters them. The ``forge`` policy never sees a duration.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from forge_scheduler.policy.engine import PolicyConfig, PolicyEngine
from forge_scheduler.policy.metrics import fairness, fragmented_gpus
from forge_scheduler.policy.model import Allocation, Job, Node, PendingJob, Placement, Snapshot, Team
from forge_scheduler.policy.usage import UsageLedger
from forge_scheduler.sim.trace import TraceError, TraceJob

POLICIES: dict[str, PolicyConfig] = {
    "forge": PolicyConfig.forge(),
    "fifo": PolicyConfig.fifo(),
    "fifo-backfill": PolicyConfig.fifo_backfill(),
    "multifactor": PolicyConfig.multifactor(),
}
ORACLE_LIMITS = {"fifo-backfill", "multifactor"}


@dataclass(frozen=True)
class SimSettings:
    """Physical assumptions of the replay, the same for every policy."""

    gpus: int
    gpus_per_node: int = 8
    nodes_per_group: int = 8
    usage_half_life_s: float = 7 * 86400.0
    tick_s: float = 600.0
    """A preempting policy also runs a cycle this often while jobs wait (tiers change with time)."""
    cycle_interval_s: float = 60.0
    """At most one cycle per this many simulated seconds: arrivals and completions inside the
    interval wait for the next cycle, as with Slurm's ``sched_interval`` (60 s) or the 60 s
    scheduling interval of Pollux's simulator, whose Philly trace this is. 0 = a cycle at every
    event instant. The same for every policy."""
    sample_s: float = 3600.0
    restart_overhead_s: float = 60.0
    """Added to a preempted job's remaining work: loading its checkpoint again."""
    checkpoint_interval_s: float = 1800.0
    min_runtime_s: float = 600.0


@dataclass
class _SimJob:
    trace: TraceJob
    job: Job
    remaining: float
    attained: float = 0.0
    queued_since: float = 0.0
    first_start: float | None = None
    end: float | None = None
    run_token: int = 0
    preemptions: int = 0


@dataclass
class ReplayResult:
    """Per-job outcomes and time series of one policy's replay."""

    policy: str
    jct: dict[str, float] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    """Seconds from submit to the first start."""
    longest_wait: dict[str, float] = field(default_factory=dict)
    """The longest single stretch each job spent pending (submit or preemption to a start)."""
    total_wait: dict[str, float] = field(default_factory=dict)
    """All the time each job spent pending, over every stretch."""
    team_of: dict[str, str] = field(default_factory=dict)
    makespan_s: float = 0.0
    utilization: float = 0.0
    fragmentation: float = 0.0
    jain_index: float = 1.0
    preemptions: int = 0
    cycles: int = 0
    series_t: list[float] = field(default_factory=list)
    series_util: list[float] = field(default_factory=list)
    series_queue_by_team: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def job_shape(num_gpus: int, gpus_per_node: int) -> tuple[int, int, Placement]:
    """(tasks, GPUs per task, placement): up to a node on one node, larger jobs as whole-node tasks."""
    if num_gpus <= gpus_per_node:
        return 1, num_gpus, Placement.SAME_NODE
    tasks = math.ceil(num_gpus / gpus_per_node)
    return tasks, math.ceil(num_gpus / tasks), Placement.ANY


def build_cluster(settings: SimSettings) -> list[Node]:
    if settings.gpus <= 0 or settings.gpus_per_node <= 0:
        raise TraceError("gpus: the cluster needs a positive number of GPUs and GPUs per node")
    if settings.gpus % settings.gpus_per_node:
        raise TraceError(
            f"gpus: {settings.gpus} is not a multiple of --gpus-per-node {settings.gpus_per_node}"
        )
    count = settings.gpus // settings.gpus_per_node
    return [
        Node(f"n{i:04d}", settings.gpus_per_node, "gpu", group=f"g{i // settings.nodes_per_group:03d}")
        for i in range(count)
    ]


def build_teams(trace: Sequence[TraceJob], gpus: int) -> dict[str, Team]:
    """Equal guarantees in one cohort with unlimited borrowing: unused quota is always lent."""
    names = sorted({j.team for j in trace})
    share = gpus // len(names)
    return {n: Team(n, {"gpu": share}, None, 1.0, "all") for n in names}


def replay(
    trace: Sequence[TraceJob], policy: str, settings: SimSettings, config: PolicyConfig | None = None
) -> ReplayResult:
    """Run one policy over the whole trace; returns its per-job outcomes and samples.

    ``config`` replaces the named policy's knobs (the name still decides whether the baselines'
    perfect time limits are given)."""
    config = replace(config or POLICIES[policy], explain=False)
    engine = PolicyEngine(config)
    nodes = build_cluster(settings)
    teams = build_teams(trace, settings.gpus)
    oracle = policy in ORACLE_LIMITS
    jobs: dict[str, _SimJob] = {}
    for t in trace:
        tasks, per, placement = job_shape(t.num_gpus, settings.gpus_per_node)
        if tasks * per > settings.gpus:
            raise TraceError(f"{t.id}: num_gpus {t.num_gpus} exceeds the {settings.gpus}-GPU cluster")
        job = Job(
            t.id,
            t.team,
            tasks,
            per,
            "gpu",
            t.priority,
            placement,
            t.submit_time,
            min_runtime_s=settings.min_runtime_s,
            time_limit_s=t.duration_s if oracle else None,
        )
        jobs[t.id] = _SimJob(t, job, t.duration_s, queued_since=t.submit_time)
    result = ReplayResult(policy)
    ledger = UsageLedger(settings.usage_half_life_s, 0.0)
    pending: dict[str, PendingJob] = {}
    running: dict[str, Allocation] = {}
    events: list[tuple[float, int, str, str, int]] = []  # (time, seq, kind, job id, run token)
    seq = 0
    arrivals = [t.id for t in trace]
    next_arrival = 0
    now = 0.0
    gpus_by_team: dict[str, int] = {}
    busy = 0
    util_area = 0.0
    frag_sum = 0.0
    frag_n = 0
    jain_sum = 0.0
    jain_n = 0
    next_sample = 0.0
    next_tick = math.inf
    dirty = True
    last_cycle = -math.inf
    wait_start: dict[str, float] = {}
    while next_arrival < len(arrivals) or pending or running:
        # 1. next instant: an arrival, a completion / preemption stop, a tick or a sample
        candidates = [next_sample]
        if next_arrival < len(arrivals):
            candidates.append(jobs[arrivals[next_arrival]].trace.submit_time)
        if events:
            candidates.append(events[0][0])
        if pending and config.preemption:
            candidates.append(next_tick)
        if dirty and pending:
            candidates.append(last_cycle + settings.cycle_interval_s)
        t_next = max(now, min(candidates))
        util_area += busy * (t_next - now)
        ledger.advance(t_next, gpus_by_team)
        now = t_next
        # 2. arrivals
        while next_arrival < len(arrivals) and jobs[arrivals[next_arrival]].trace.submit_time <= now:
            sj = jobs[arrivals[next_arrival]]
            pending[sj.job.id] = PendingJob(sj.job, 0.0, sj.trace.submit_time)
            wait_start[sj.job.id] = now
            next_arrival += 1
            dirty = True
        # 3. completions and preemption stops
        while events and events[0][0] <= now:
            _, _, kind, job_id, token = heapq.heappop(events)
            sj = jobs[job_id]
            if token != sj.run_token or job_id not in running:
                continue
            alloc = running.pop(job_id)
            busy -= sj.job.gpus
            gpus_by_team[sj.job.team] -= sj.job.gpus
            dirty = True
            if kind == "end":
                sj.end = now
                result.jct[job_id] = now - sj.trace.submit_time
                started = sj.first_start if sj.first_start is not None else now
                result.queue[job_id] = started - sj.trace.submit_time
                result.team_of[job_id] = sj.job.team
            else:
                sj.run_token += 1
                sj.preemptions += 1
                result.preemptions += 1
                sj.queued_since = now
                pending[job_id] = PendingJob(sj.job, sj.attained, now)
                wait_start[job_id] = now
                del alloc
        # 4. samples: utilisation series, queue time by team, fragmentation, fairness
        if now >= next_sample:
            _sample(result, now, busy, settings, nodes, running, pending, teams, wait_start)
            if pending:
                free = _free_by_node(nodes, running)
                frag_sum += (
                    fragmented_gpus(free, (p.job.gpus_per_task for p in pending.values())) / settings.gpus
                )
                frag_n += 1
                demand: dict[str, float] = dict.fromkeys(teams, 0.0)
                for p in pending.values():
                    demand[p.job.team] += p.job.gpus
                for a in running.values():
                    demand[a.job.team] += a.job.gpus
                active = {k: v for k, v in demand.items() if v > 0}
                if len(active) > 1:
                    jain, _ = fairness(
                        settings.gpus, {k: float(v) for k, v in gpus_by_team.items()}, active, {}
                    )
                    jain_sum += jain
                    jain_n += 1
            next_sample = now + settings.sample_s
        if config.preemption and now >= next_tick:
            dirty = True
        # 5. a cycle when something changed (and the last one is an interval ago)
        if dirty and pending and now >= last_cycle + settings.cycle_interval_s:
            dirty = False
            last_cycle = now
            next_tick = now + settings.tick_s
            result.cycles += 1
            decision = engine.cycle(
                Snapshot(nodes, teams, list(pending.values()), list(running.values()), ledger.snapshot()), now
            )
            for stop in decision.preemptions:
                alloc = running[stop.job_id]
                sj = jobs[stop.job_id]
                done = now - alloc.start_time
                sj.remaining = max(0.0, sj.remaining - done) + settings.restart_overhead_s
                sj.attained += sj.job.gpus * done
                running[stop.job_id] = replace(alloc, preempting=True)
                sj.run_token += 1
                seq += 1
                heapq.heappush(events, (max(now, stop.stop_by), seq, "stop", stop.job_id, sj.run_token))
            for start in decision.starts:
                sj = jobs[start.job_id]
                pending.pop(start.job_id)
                waited = now - wait_start.pop(start.job_id, now)
                if waited > result.longest_wait.get(start.job_id, -1.0):
                    result.longest_wait[start.job_id] = waited
                result.total_wait[start.job_id] = result.total_wait.get(start.job_id, 0.0) + waited
                if sj.first_start is None:
                    sj.first_start = now
                running[start.job_id] = Allocation(
                    sj.job,
                    start.slots,
                    now,
                    None,
                    sj.attained,
                    start.borrowed,
                    checkpoint_interval_s=settings.checkpoint_interval_s,
                )
                busy += sj.job.gpus
                gpus_by_team[sj.job.team] = gpus_by_team.get(sj.job.team, 0) + sj.job.gpus
                seq += 1
                heapq.heappush(events, (now + sj.remaining, seq, "end", start.job_id, sj.run_token))
        elif not pending:
            next_tick = math.inf
    first = trace[0].submit_time if trace else 0.0
    result.makespan_s = now - first
    result.utilization = util_area / (settings.gpus * result.makespan_s) if result.makespan_s > 0 else 0.0
    result.fragmentation = frag_sum / frag_n if frag_n else 0.0
    result.jain_index = jain_sum / jain_n if jain_n else 1.0
    return result


def _free_by_node(nodes: Sequence[Node], running: dict[str, Allocation]) -> dict[str, int]:
    free = {n.name: n.gpus for n in nodes}
    for a in running.values():
        for name, gpus in a.slots:
            free[name] -= gpus
    return free


def _sample(
    result: ReplayResult,
    now: float,
    busy: int,
    settings: SimSettings,
    nodes: Sequence[Node],
    running: dict[str, Allocation],
    pending: dict[str, PendingJob],
    teams: dict[str, Team],
    wait_start: dict[str, float],
) -> None:
    result.series_t.append(now)
    result.series_util.append(busy / settings.gpus)
    oldest: dict[str, float] = {}
    for job_id, since in wait_start.items():
        team = pending[job_id].job.team if job_id in pending else ""
        if team:
            oldest[team] = max(oldest.get(team, 0.0), now - since)
    for team in teams:
        result.series_queue_by_team.setdefault(team, []).append((now, oldest.get(team, 0.0)))


def pooled_sjf_avg_jct(trace: Sequence[TraceJob], gpus: int) -> float:
    """Capacity relaxation: one pool of ``gpus`` GPUs, no placement, oracle shortest-job-first.

    Not a proven bound (SJF is not optimal on many servers) but the reference the targets quote:
    what an ideal scheduler with perfect knowledge and no topology could reach.
    """
    events: list[tuple[float, int]] = []
    waiting: list[tuple[float, int, int]] = []
    free = gpus
    total = 0.0
    i = 0
    n = len(trace)
    done = 0
    now = 0.0
    while done < n:
        t_arr = trace[i].submit_time if i < n else math.inf
        t_end = events[0][0] if events else math.inf
        now = min(t_arr, t_end)
        while events and events[0][0] <= now:
            _, g = heapq.heappop(events)
            free += g
        while i < n and trace[i].submit_time <= now:
            heapq.heappush(waiting, (trace[i].duration_s, i, trace[i].num_gpus))
            i += 1
        skipped: list[tuple[float, int, int]] = []
        while waiting and free > 0 and len(skipped) < 64:
            d, k, g = heapq.heappop(waiting)
            if g <= free:
                free -= g
                heapq.heappush(events, (now + d, g))
                total += now + d - trace[k].submit_time
                done += 1
            else:
                skipped.append((d, k, g))
        for item in skipped:
            heapq.heappush(waiting, item)
    return total / n if n else 0.0
