"""The scheduling cycle: admission, ordering, gang placement, reservation + backfill, preemption.

``PolicyEngine.cycle(snapshot, now)`` is pure: it reads a snapshot and returns decisions. The
service applies them to its database and agents; the simulator applies them to its event queue.
Baselines (strict FIFO, FIFO + backfill, Slurm-like multifactor) are configurations of the same
engine, so every policy is measured with the same placement code.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from forge_scheduler.policy.capacity import CapacityIndex, Slots
from forge_scheduler.policy.model import (
    ANY_GPU_TYPE,
    Allocation,
    Job,
    Node,
    PendingJob,
    Placement,
    Priority,
    Snapshot,
    Team,
)

Ordering = Literal["forge", "fifo", "multifactor"]


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of one policy; ``forge()``, ``fifo()``, ``fifo_backfill()``, ``multifactor()`` are the recipes."""

    ordering: Ordering = "forge"
    strict: bool = False
    """Strict FIFO: nothing behind the first job that does not fit may start."""
    backfill: bool = True
    """Reserve for the head-of-line gang that does not fit; others use only what it does not need."""
    preemption: bool = True
    las_tiers_gpu_s: tuple[float, ...] = (2 * 3600.0, 16 * 3600.0, 128 * 3600.0)
    """Attained-service tiers (GPU-seconds): a job that has used less goes first (Tiresias 2D-LAS),
    which favours short jobs without knowing any duration."""
    las_preemption: bool = True
    """Within one priority class, a job of a lower tier may preempt one of a higher tier."""
    aging_s: float = 6 * 3600.0
    """Every ``aging_s`` of waiting lifts a job one tier, so nothing starves under small jobs."""
    preemption_grace_s: float = 60.0
    """Time a victim gets to checkpoint before it must stop."""
    max_preemption_searches: int = 8
    """Bound on victim searches per cycle, which keeps one cycle's cost bounded."""
    max_victims: int = 64
    """A gang that would need more victims than this waits for its reservation instead."""
    multifactor_weights: tuple[float, float, float] = (1000.0, 1000.0, 100.0)
    """Slurm PriorityWeight{Age, FairShare, JobSize}."""
    multifactor_max_age_s: float = 7 * 86400.0
    explain: bool = True
    """Compute a pending reason for every job (the service); the simulator turns it off."""

    @staticmethod
    def forge() -> PolicyConfig:
        return PolicyConfig()

    @staticmethod
    def fifo() -> PolicyConfig:
        return PolicyConfig(ordering="fifo", strict=True, backfill=False, preemption=False)

    @staticmethod
    def fifo_backfill() -> PolicyConfig:
        return PolicyConfig(ordering="fifo", backfill=True, preemption=False)

    @staticmethod
    def multifactor() -> PolicyConfig:
        return PolicyConfig(ordering="multifactor", backfill=True, preemption=False)


@dataclass(frozen=True)
class Start:
    job_id: str
    slots: Slots
    borrowed: bool


@dataclass(frozen=True)
class Preemption:
    job_id: str
    for_job: str
    reason: str
    stop_by: float
    """The victim checkpoints until then (grace period), then its GPUs are released."""


@dataclass(frozen=True)
class Reservation:
    job_id: str
    nodes: tuple[str, ...]
    estimated_start: float | None


@dataclass
class CycleResult:
    starts: list[Start] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None
    order: list[str] = field(default_factory=list)
    """Pending job ids in the order the cycle considered them."""


class _Quota:
    """Per-cycle quota book: GPUs in use per (team, type) and what each cohort can still lend.

    The cohort's unused guarantees are kept incrementally, so admitting one job is O(1).
    """

    def __init__(self, teams: Mapping[str, Team], capacity: Mapping[str, int]) -> None:
        self.teams = teams
        self.capacity = dict(capacity)
        self.used: dict[tuple[str, str], int] = {}
        self._team_total: dict[str, int] = {}
        self._borrowed: dict[str, int] = {}
        self._decided: dict[tuple[str, str, int, bool], tuple[bool, bool, str]] = {}
        guaranteed: dict[str, int] = {}
        self._unused: dict[tuple[str, str], int] = {}
        for team in teams.values():
            for t, g in team.guaranteed.items():
                guaranteed[t] = guaranteed.get(t, 0) + g
                key = (team.cohort, t)
                self._unused[key] = self._unused.get(key, 0) + g
        self._unassigned = {t: max(0, cap - guaranteed.get(t, 0)) for t, cap in capacity.items()}

    def _used(self, team: str, t: str) -> int:
        if t == ANY_GPU_TYPE:
            return self._team_total.get(team, 0)
        return self.used.get((team, t), 0)

    def within_guarantee(self, team: Team, t: str, gpus: int) -> bool:
        return self._used(team.name, t) + gpus <= team.guarantee(t)

    def cohort_spare(self, cohort: str, t: str) -> int:
        """Unused guarantees of the cohort plus capacity guaranteed to nobody."""
        if t == ANY_GPU_TYPE:
            return sum(self._unassigned.values()) + sum(
                v for (c, _), v in self._unused.items() if c == cohort
            )
        return self._unassigned.get(t, 0) + self._unused.get((cohort, t), 0)

    def admit(self, team: Team, job: Job) -> tuple[bool, bool, str]:
        """(admitted, borrowed, reason). Production inference is never held back by quota.

        Decisions are remembered per (team, GPU type, size, production) until quota is next booked:
        most of a long queue asks again for the same few shapes.
        """
        key = (
            team.name,
            job.gpu_type,
            job.tasks * job.gpus_per_task,
            job.priority is Priority.PRODUCTION_INFERENCE,
        )
        decision = self._decided.get(key)
        if decision is None:
            decision = self._decided[key] = self._admit(team, job)
        return decision

    def _admit(self, team: Team, job: Job) -> tuple[bool, bool, str]:
        t, need = job.gpu_type, job.tasks * job.gpus_per_task
        if t != ANY_GPU_TYPE:
            if self.used.get((team.name, t), 0) + need <= team.guaranteed.get(t, 0):
                return True, False, ""
        elif self.within_guarantee(team, t, need):
            return True, False, ""
        if job.priority is Priority.PRODUCTION_INFERENCE:
            return True, False, ""
        used = self._used(team.name, t)
        over = used + need - max(team.guarantee(t), used)
        if team.borrow_limit is not None and self._borrowed.get(team.name, 0) + over > team.borrow_limit:
            return (
                False,
                False,
                f"team quota exhausted and borrowing limit of {team.borrow_limit} GPUs reached",
            )
        own_unused = max(0, team.guarantee(t) - used)  # the job fills the team's own guarantee first
        if self.cohort_spare(team.cohort, t) - own_unused < over:
            return False, False, "team quota exhausted and cohort has no spare"
        return True, True, ""

    def add(self, team_name: str, slots: Slots, nodes: Mapping[str, Node]) -> None:
        by_type: dict[str, int] = {}
        for name, gpus in slots:
            t = nodes[name].gpu_type
            by_type[t] = by_type.get(t, 0) + gpus
        for t, gpus in by_type.items():
            self.add_gpus(team_name, t, gpus)

    def add_gpus(self, team_name: str, t: str, gpus: int) -> None:
        """Book ``gpus`` of type ``t`` to the team: inside its guarantee first, then borrowed."""
        self._decided.clear()
        team = self.teams.get(team_name)
        key = (team_name, t)
        before = self.used.get(key, 0)
        after = before + gpus
        self.used[key] = after
        self._team_total[team_name] = self._team_total.get(team_name, 0) + gpus
        g = team.guarantee(t) if team else 0
        self._borrowed[team_name] = self._borrowed.get(team_name, 0) + max(0, after - g) - max(0, before - g)
        inside = min(after, g) - min(before, g)
        if inside and team is not None:
            self._unused[(team.cohort, t)] -= inside
        outside = max(0, after - g) - max(0, before - g)
        if outside:
            # borrowed GPUs come first from capacity nobody is guaranteed, then from the cohort
            from_unassigned = min(outside, self._unassigned.get(t, 0))
            self._unassigned[t] = self._unassigned.get(t, 0) - from_unassigned
            if team is not None and outside > from_unassigned:
                self._unused[(team.cohort, t)] = self._unused.get((team.cohort, t), 0) - (
                    outside - from_unassigned
                )


class PolicyEngine:
    """Runs one scheduling cycle over a snapshot. Stateless between cycles; the clock is ``now``."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    # ------------------------------------------------------------------ ordering
    def tier(self, attained_gpu_s: float) -> int:
        """Attained-service tier: 0 for a job that has used less than the first threshold."""
        return bisect.bisect_right(self.config.las_tiers_gpu_s, attained_gpu_s)

    def _effective_tier(self, p: PendingJob, now: float) -> int:
        """Tier lowered by one per ``aging_s`` waited, so a long job cannot starve."""
        return max(
            0, self.tier(p.attained_gpu_s) - int(max(0.0, now - p.waiting_since) // self.config.aging_s)
        )

    def _fair_scores(
        self, snap: Snapshot, capacity: Mapping[str, int], held: Mapping[tuple[str, str], int]
    ) -> dict[str, float]:
        """Weighted dominant share of current allocation plus share of decayed usage (lower first).

        ``held``: GPUs in use per (team, GPU type).
        """
        total_usage = sum(snap.usage.values()) or 1.0
        scores: dict[str, float] = {}
        for team in snap.teams.values():
            dominant = max(
                (held.get((team.name, t), 0) / cap for t, cap in capacity.items() if cap > 0), default=0.0
            )
            scores[team.name] = (dominant + snap.usage.get(team.name, 0.0) / total_usage) / max(
                team.weight, 1e-9
            )
        return scores

    def _order(
        self,
        snap: Snapshot,
        now: float,
        capacity: Mapping[str, int],
        held: Mapping[tuple[str, str], int],
    ) -> tuple[list[PendingJob], list[str]]:
        """The pending jobs in the order the cycle considers them, and their ids."""
        cfg = self.config
        if cfg.ordering != "forge":
            return self._order_baseline(snap, now, capacity)
        fair = self._fair_scores(snap, capacity, held)
        tiers = cfg.las_tiers_gpu_s
        first = tiers[0] if tiers else math.inf
        aging = cfg.aging_s
        bisect_right = bisect.bisect_right
        # The key is (head, waiting since, job id), head = priority, tier and the team's fair
        # score as one small integer (the score enters as its rank). It is sorted as three stable
        # passes over plain lists, least significant first, instead of one sort of per-job
        # tuples: 10,000 tuples cost more to build than to sort, and they are the bulk of what a
        # cycle allocates (each allocation burst brings the cyclic garbage collector closer).
        ranks = {score: r for r, score in enumerate(sorted({*fair.values(), 0.0}))}
        team_rank = {team: ranks[score] for team, score in fair.items()}
        unknown = ranks[0.0]
        per_tier = len(ranks)
        per_priority = (len(tiers) + 1) * per_tier
        pending = snap.pending
        heads: list[int] = []
        sinces: list[float] = []
        ids: list[str] = []
        add_head, add_since, add_id = heads.append, sinces.append, ids.append
        for p in pending:
            job = p.job
            since = job.submit_time if p.queued_since is None else p.queued_since
            head = team_rank.get(job.team, unknown) - int(job.priority) * per_priority
            attained = p.attained_gpu_s
            if attained >= first:
                tier = bisect_right(tiers, attained)
                if now > since:
                    tier = max(0, tier - int((now - since) // aging))
                head += tier * per_tier
            add_head(head)
            add_since(since)
            add_id(job.id)
        order = sorted(range(len(ids)), key=ids.__getitem__)
        order.sort(key=sinces.__getitem__)
        order.sort(key=heads.__getitem__)
        return [pending[i] for i in order], [ids[i] for i in order]

    def _order_baseline(
        self, snap: Snapshot, now: float, capacity: Mapping[str, int]
    ) -> tuple[list[PendingJob], list[str]]:
        """Strict FIFO and FIFO + backfill: submit time; multifactor: Slurm's weighted sum.

        Ties go to the lower job id. A long queue is re-sorted every cycle, so the keys are numpy
        columns sorted in C (:func:`_lex_order`) rather than a Python key per job.
        """
        cfg = self.config
        pending = snap.pending
        jobs = [p.job for p in pending]
        ids = [job.id for job in jobs]
        submit = np.array([job.submit_time for job in jobs], dtype=np.float64)
        if cfg.ordering == "fifo":
            order = _lex_order([submit], ids)
        elif cfg.ordering == "multifactor":
            w_age, w_fs, w_size = cfg.multifactor_weights
            total = sum(capacity.values()) or 1
            usage_total = sum(snap.usage.values()) or 1.0
            weights_total = sum(t.weight for t in snap.teams.values()) or 1.0
            fs: dict[str, float] = {}
            for team in snap.teams.values():
                share = team.weight / weights_total
                fs[team.name] = 2.0 ** (-(snap.usage.get(team.name, 0.0) / usage_total) / share)
            fs_of = fs.get
            # Slurm's job priority: age (capped), fair share and size, each weighted; higher first.
            age = np.minimum(1.0, np.maximum(0.0, now - submit) / cfg.multifactor_max_age_s)
            share_col = np.array([fs_of(job.team, 0.0) for job in jobs], dtype=np.float64)
            size = np.array([job.tasks * job.gpus_per_task for job in jobs], dtype=np.float64)
            score = w_age * age + w_fs * share_col + w_size * size / total
            priority = np.array([int(job.priority) for job in jobs], dtype=np.float64)
            order = _lex_order([-priority, -score, submit], ids)
        else:
            raise ValueError(f"ordering: unknown {cfg.ordering!r}")
        return [pending[i] for i in order], [ids[i] for i in order]

    # ------------------------------------------------------------------ the cycle
    def cycle(self, snap: Snapshot, now: float) -> CycleResult:
        """One cycle.

        1. Build the free-GPU index from the nodes minus running allocations; inference-pool
           nodes go to their own index that only production inference may use.
        2. Book quota in use per team and GPU type.
        3. Order the pending jobs: priority class, then attained-service tier with aging, then
           the team's weighted dominant share with decayed usage, then waiting time.
        4. For each job in order: admit it by quota (borrowing inside its cohort), then try to
           place the whole gang best-fit within its topology constraint.
        5. A job that does not fit may preempt (higher class over lower, reclaim of borrowed
           quota, lower LAS tier over higher), choosing the cheapest victims past their minimum
           runtime; the GPUs being freed are held for it.
        6. The first job that neither fits nor preempts gets a reservation on the nodes closest to
           fitting; later jobs backfill only outside it (or inside, if their declared limit ends
           before the reservation's estimated start). Strict FIFO stops here instead.
        7. Every job left pending gets its reason in words.
        """
        cfg = self.config
        result = CycleResult()
        nodes = {n.name: n for n in snap.nodes}
        # 1. free-GPU index (and, in the same pass over the running jobs, GPUs held per team and type)
        used: dict[str, int] = {}
        held: dict[tuple[str, str], int] = {}
        for a in snap.running:
            team_name = a.job.team
            for name, gpus in a.slots:
                used[name] = used.get(name, 0) + gpus
                key = (team_name, nodes[name].gpu_type)
                held[key] = held.get(key, 0) + gpus
        general = CapacityIndex([], {})
        pool = CapacityIndex([], {})
        capacity: dict[str, int] = {}
        for n in snap.nodes:
            (pool if n.inference_pool else general).add_node(n, n.gpus - used.get(n.name, 0))
            capacity[n.gpu_type] = capacity.get(n.gpu_type, 0) + n.gpus
        # 2. quota book
        quota = _Quota(snap.teams, capacity)
        for (team_name, gpu_type), gpus in held.items():
            quota.add_gpus(team_name, gpu_type, gpus)
        preemptable = cfg.preemption and bool(snap.running)
        if not cfg.explain and general.total_free == 0 and pool.total_free == 0 and not preemptable:
            return result
        # 3. order
        ordered, result.order = self._order(snap, now, capacity, held)
        in_flight = [a for a in snap.running if a.preempting]
        claimed: set[str] = set()
        victims: _VictimQueue | None = None
        failed: set[tuple[object, ...]] = set()
        no_fit: set[tuple[object, ...]] = set()
        started: list[tuple[Job, Slots]] = []
        reserved_free: dict[str, int] = {}
        searches = 0
        blocked_at: int | None = None
        higher = 0
        fit_reasons: dict[tuple[object, ...], str] = {}

        def fit_reason(job: Job) -> str:
            key = (job.gpu_type, id(job.placement), job.tasks, job.gpus_per_task, general.total_free)
            text = fit_reasons.get(key)
            if text is None:
                text = fit_reasons[key] = self._fit_reason(job, general)
            return text

        explain, max_searches = cfg.explain, cfg.max_preemption_searches if cfg.preemption else 0
        production = Priority.PRODUCTION_INFERENCE
        for rank, p in enumerate(ordered):
            job = p.job
            if general.total_free == 0 and pool.total_free == 0 and searches >= max_searches:
                # nothing more can start or preempt this cycle: the rest only needs its reason
                if explain:
                    # quota and free GPUs no longer change: one answer per team and shape
                    answers: dict[tuple[object, ...], tuple[str, bool]] = {}
                    for later, q in enumerate(ordered[rank:], start=higher):
                        qjob = q.job
                        asks = (
                            qjob.team,
                            qjob.gpu_type,
                            id(qjob.placement),
                            qjob.tasks,
                            qjob.gpus_per_task,
                            qjob.priority is production,
                        )
                        answer = answers.get(asks)
                        if answer is None:
                            qteam = snap.teams.get(qjob.team)
                            why = (
                                f"unknown team {qjob.team!r}"
                                if qteam is None
                                else quota.admit(qteam, qjob)[2]
                            )
                            answer = answers[asks] = (why or fit_reason(qjob), not why)
                        why, ranked = answer
                        if ranked and later:
                            why = f"{why}; behind {later} job(s) of higher rank"
                        result.reasons[qjob.id] = why
                break
            if blocked_at is not None:
                if not explain:
                    break  # nothing behind the blocked head may start
                result.reasons[job.id] = f"behind {rank - blocked_at} earlier jobs (strict FIFO)"
                continue
            team = snap.teams.get(job.team)
            if team is None:
                result.reasons[job.id] = f"unknown team {job.team!r}"
                continue
            # 4. admission, then placement
            ok, borrowed, why = quota.admit(team, job)
            if not ok:
                result.reasons[job.id] = why
                continue
            slots = None
            if job.priority is production:
                slots = pool.place(job)
            # id() of the enum member: a cheap memo key (Enum.__hash__ is Python-level)
            fit_key = (job.gpu_type, id(job.placement), job.tasks, job.gpus_per_task)
            if slots is None and fit_key not in no_fit:
                # free capacity only shrinks during a cycle: a shape that failed fails again
                slots = general.place(job)
                if slots is None:
                    no_fit.add(fit_key)
            if slots is None and result.reservation is not None and job.time_limit_s is not None:
                slots = self._backfill_into_reservation(job, now, result.reservation, nodes, reserved_free)
            if slots is not None:
                quota.add(job.team, slots, nodes)
                result.starts.append(Start(job.id, slots, borrowed))
                started.append((job, slots))
                continue
            # 5. preemption (a search that failed for this class, tier and shape fails again)
            search = searches < max_searches
            if search:
                my_tier = self._effective_tier(p, now)
                shape = (
                    int(job.priority),
                    my_tier,
                    job.gpus,
                    id(job.placement),
                    job.gpu_type,
                    quota.within_guarantee(team, job.gpu_type, job.gpus),
                )
                search = shape not in failed
            if search:
                searches += 1
                if victims is None:
                    victims = self._victim_pool(snap, now)
                plan = self._preempt(p, my_tier, team, quota, victims, general, in_flight, claimed)
                if plan is None:
                    failed.add(shape)
                else:
                    chosen, hold, waiting_only = plan
                    for v, reason in chosen:
                        claimed.add(v.job.id)
                        result.preemptions.append(
                            Preemption(
                                v.job.id,
                                job.id,
                                reason,
                                now + (cfg.preemption_grace_s if v.job.checkpointable else 0.0),
                            )
                        )
                    for name in hold:
                        if name in general.nodes:
                            general.remove_node(name)
                    if explain:
                        result.reasons[job.id] = (
                            "waiting for preempted jobs to checkpoint and stop"
                            if waiting_only
                            else f"preempting {len(chosen)} job(s); starts after the {cfg.preemption_grace_s:.0f} s grace period"
                        )
                    higher += 1
                    continue
            # 6. reservation / strict stop
            if cfg.strict:
                blocked_at = rank
                if explain:
                    result.reasons[job.id] = fit_reason(job)
                continue
            # 7. reason (before the reservation takes the nodes it names out of the index)
            if explain:
                reason = fit_reason(job)
                if higher:
                    reason += f"; behind {higher} job(s) of higher rank"
                result.reasons[job.id] = reason
            if cfg.backfill and result.reservation is None:
                result.reservation = self._reserve(job, now, general, snap, started, reserved_free)
            higher += 1
        return result

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _fit_reason(job: Job, index: CapacityIndex) -> str:
        block = index.largest_block(job)
        where = {
            Placement.SAME_NODE: "one node",
            Placement.SAME_GROUP: "one node group",
            Placement.ANY: "the cluster",
        }[job.placement]
        kind = f" {job.gpu_type}" if job.gpu_type else ""
        return f"waiting for {job.gpus}{kind} GPUs in {where}; largest free block is {block}"

    def _reserve(
        self,
        job: Job,
        now: float,
        index: CapacityIndex,
        snap: Snapshot,
        started: list[tuple[Job, Slots]],
        reserved_free: dict[str, int],
    ) -> Reservation:
        """Hold the nodes closest to fitting ``job``; estimate its start where limits are known.

        Nodes go most-free first and, among equally free ones, the one whose jobs' declared limits
        end first. End times are looked up only for the nodes that can be chosen: scanning every
        running job per node would cost more than the rest of the cycle.
        """
        ends: dict[str, float] = {}

        def look_up_ends(names: Iterable[str]) -> None:
            wanted = {name for name in names if name not in ends}
            if not wanted:
                return
            found: dict[str, float] = {}

            def note(name: str, holder: Job, since: float) -> None:
                end = math.inf if holder.time_limit_s is None else since + holder.time_limit_s
                found[name] = max(found.get(name, -math.inf), end)

            for a in snap.running:
                for name, _ in a.slots:
                    if name in wanted:
                        note(name, a.job, a.start_time)
            for j, slots in started:  # started earlier in this cycle
                for name, _ in slots:
                    if name in wanted:
                        note(name, j, now)
            for name in wanted:
                ends[name] = found.get(name, now)  # a node without jobs is free now

        types = index.types_for(job)
        chosen: list[Node] = []
        if job.placement is Placement.SAME_NODE:
            for _, level in index.by_free(types):
                fits = [n for n in level if n.gpus >= job.gpus]
                if fits:
                    look_up_ends(n.name for n in fits)
                    chosen = [min(fits, key=lambda n: (ends[n.name], n.name))]
                    break
        elif job.placement is Placement.SAME_GROUP:
            candidates = [n for n in index.nodes.values() if n.gpu_type in types]
            groups: dict[str, list[Node]] = {}
            for n in candidates:
                groups.setdefault(n.group, []).append(n)
            best = sorted(groups.items(), key=lambda kv: (-sum(index.free[n.name] for n in kv[1]), kv[0]))
            if best:
                members = sorted(best[0][1], key=lambda n: (-index.free[n.name], n.name))
                total = 0
                for n in members:
                    chosen.append(n)
                    total += n.gpus
                    if total >= job.gpus:
                        break
            look_up_ends(n.name for n in chosen)
        else:
            # whole levels until they hold the gang; only the last level's order depends on ends
            levels: list[list[Node]] = []
            total = 0
            for _, level in index.by_free(types):
                levels.append(level)
                total += sum(n.gpus for n in level)
                if total >= job.gpus:
                    break
            look_up_ends(n.name for level in levels for n in level)
            total = 0
            for level in levels:
                for n in sorted(level, key=lambda n: (ends[n.name], n.name)):
                    chosen.append(n)
                    total += n.gpus
                    if total >= job.gpus:
                        break
                if total >= job.gpus:
                    break
        est = max((ends[n.name] for n in chosen), default=now)
        for n in chosen:
            reserved_free[n.name] = index.remove_node(n.name)
        return Reservation(job.id, tuple(n.name for n in chosen), None if math.isinf(est) else est)

    @staticmethod
    def _backfill_into_reservation(
        job: Job,
        now: float,
        reservation: Reservation,
        nodes: Mapping[str, Node],
        reserved_free: dict[str, int],
    ) -> Slots | None:
        """A job whose declared limit ends before the reservation starts may use reserved nodes."""
        if reservation.estimated_start is None or job.time_limit_s is None:
            return None
        if now + job.time_limit_s > reservation.estimated_start:
            return None
        side = CapacityIndex([], {})
        for name in reservation.nodes:
            side.add_node(nodes[name], reserved_free[name])
        slots = side.place(job, commit=False)
        # reserved nodes stay out of the general index; book the GPUs so later backfills see them
        for name, gpus in slots or ():
            reserved_free[name] -= gpus
        return slots

    def _victim_reason(
        self, victim: _Victim, p: PendingJob, my_tier: int, team: Team, quota: _Quota
    ) -> str | None:
        """Why ``victim`` may be preempted for ``p``, or ``None`` if it may not."""
        job, v = p.job, victim.alloc.job
        if v.priority < job.priority:
            return f"preempted by higher priority {job.priority.name.lower()} job {job.id}"
        if v.priority > job.priority:
            return None
        if (
            victim.alloc.borrowed
            and v.team != job.team
            and victim.cohort == team.cohort
            and quota.within_guarantee(team, job.gpu_type, job.gpus)
        ):
            return f"borrowed quota reclaimed by team {job.team}"
        if self.config.las_preemption and victim.tier > my_tier:
            return f"yielded to job {job.id} with less attained service (tier {my_tier} < {victim.tier})"
        return None

    def _victim_pool(self, snap: Snapshot, now: float) -> _VictimQueue:
        """Running jobs that may be preempted at all (past minimum runtime, not production
        inference, not already stopping), cheapest first: cost = GPUs × time since last checkpoint."""
        keys: list[tuple[float, str, int]] = []
        append = keys.append
        production = Priority.PRODUCTION_INFERENCE
        running = snap.running
        for i, a in enumerate(running):
            v = a.job
            start = a.start_time
            if a.preempting or v.priority is production or now - start < v.min_runtime_s:
                continue
            # Allocation.last_checkpoint, inlined: this loop runs over every running job
            last = a.last_checkpoint_time
            if last is None:
                last = start
                interval = a.checkpoint_interval_s
                if interval and v.checkpointable:
                    last = start + (max(0.0, now - start) // interval) * interval
            append((v.tasks * v.gpus_per_task * max(0.0, now - last), v.id, i))
        return _VictimQueue(self, snap, now, keys)

    def _preempt(
        self,
        p: PendingJob,
        my_tier: int,
        team: Team,
        quota: _Quota,
        victims: _VictimQueue,
        general: CapacityIndex,
        in_flight: list[Allocation],
        claimed: set[str],
    ) -> tuple[list[tuple[Allocation, str]], list[str], bool] | None:
        """Cheapest victim set that lets ``p`` fit, with the nodes to hold for it; ``None`` if none.

        Victims already being preempted count as free first (no new victims are then needed).
        """
        job = p.job
        if job.placement is Placement.SAME_NODE and job.gpu_type != ANY_GPU_TYPE:
            return self._preempt_one_node(p, my_tier, team, quota, victims, general, in_flight, claimed)
        # trial on the real index, undone before returning: copying 1,000 nodes costs more
        trial = general
        given: list[Slots] = []

        def free_up(slots: Slots) -> None:
            mine = tuple((n, g) for n, g in slots if n in trial.nodes)
            trial.give(mine)
            given.append(mine)

        def undo() -> None:
            for slots in reversed(given):
                trial.take(slots)

        pending_free = [a for a in in_flight if a.job.id not in claimed]
        for a in pending_free:
            free_up(a.slots)
        slots = trial.place(job, commit=False)
        if slots is not None and pending_free:
            undo()
            return [], sorted({n for n, _ in slots}), True
        chosen: list[tuple[_Victim, str]] = []
        for c in victims:
            if c.job_id in claimed or any(n not in trial.nodes for n, _ in c.alloc.slots):
                continue
            why = self._victim_reason(c, p, my_tier, team, quota)
            if why is None:
                continue
            chosen.append((c, why))
            if len(chosen) > self.config.max_victims:
                undo()
                return None
            free_up(c.alloc.slots)
            # only a node that now holds a whole task can change the answer
            helps = any(trial.free[n] >= job.gpus_per_task for n, _ in c.alloc.slots)
            if helps and trial.place(job, commit=False) is not None:
                break
        else:
            undo()
            return None
        # prune victims that turned out unnecessary, most expensive first
        dropped: set[str] = set()
        for victim, _ in sorted(chosen, key=lambda i: (-i[0].cost, i[0].job_id)):
            trial.take(victim.alloc.slots)
            if trial.place(job, commit=False) is None:
                trial.give(victim.alloc.slots)
            else:
                dropped.add(victim.job_id)
                given.remove(victim.alloc.slots)
        chosen = [item for item in chosen if item[0].job_id not in dropped]
        slots = trial.place(job, commit=False)
        undo()
        hold = sorted({n for n, _ in slots or ()})
        return [(c.alloc, why) for c, why in chosen], hold, False

    def _preempt_one_node(
        self,
        p: PendingJob,
        my_tier: int,
        team: Team,
        quota: _Quota,
        victims: _VictimQueue,
        general: CapacityIndex,
        in_flight: list[Allocation],
        claimed: set[str],
    ) -> tuple[list[tuple[Allocation, str]], list[str], bool] | None:
        """Single-node gangs: per node, add the cheapest eligible victims until the gang fits; the
        first node to fit wins (its most expensive victim is the cheapest possible)."""
        job = p.job
        need = job.gpus
        gained: dict[str, int] = {}
        for a in in_flight:
            if a.job.id in claimed:
                continue
            for name, gpus in a.slots:
                if name in general.nodes and general.nodes[name].gpu_type == job.gpu_type:
                    gained[name] = gained.get(name, 0) + gpus
                    if general.free[name] + gained[name] >= need:
                        return [], [name], True
        picked: dict[str, list[tuple[Allocation, str]]] = {}
        for c in victims:
            if c.job_id in claimed:
                continue
            names = [
                n
                for n, _ in c.alloc.slots
                if n in general.nodes and general.nodes[n].gpu_type == job.gpu_type
            ]
            if not names:
                continue
            why = self._victim_reason(c, p, my_tier, team, quota)
            if why is None:
                continue
            for name, gpus in c.alloc.slots:
                if name not in general.nodes or general.nodes[name].gpu_type != job.gpu_type:
                    continue
                gained[name] = gained.get(name, 0) + gpus
                chosen = picked.setdefault(name, [])
                if not chosen or chosen[-1][0] is not c.alloc:
                    chosen.append((c.alloc, why))
                if general.free[name] + gained[name] >= need and general.nodes[name].gpus >= need:
                    return chosen, [name], False
        return None


@dataclass(frozen=True, eq=False)
class _Victim:
    cost: float
    job_id: str
    alloc: Allocation
    tier: int
    cohort: str


class _VictimQueue:
    """The victim pool in cost order, sorted lazily from a heap: a search usually stops after the
    first few victims, and most cycles search a few times, so sorting every running job is waste.

    Iterating it again starts from the cheapest; ties in cost go by job id, then snapshot order.
    """

    def __init__(
        self, engine: PolicyEngine, snap: Snapshot, now: float, keys: list[tuple[float, str, int]]
    ) -> None:
        heapq.heapify(keys)
        self._heap = keys
        self._sorted: list[_Victim] = []
        self._engine = engine
        self._snap = snap
        self._now = now

    def _pop(self) -> _Victim:
        cost, job_id, i = heapq.heappop(self._heap)
        a = self._snap.running[i]
        team = self._snap.teams.get(a.job.team)
        victim = _Victim(
            cost, job_id, a, self._engine.tier(a.attained(self._now)), team.cohort if team else ""
        )
        self._sorted.append(victim)
        return victim

    def __iter__(self) -> Iterator[_Victim]:
        for i in itertools.count():
            if i < len(self._sorted):
                yield self._sorted[i]
            elif self._heap:
                yield self._pop()
            else:
                return


def never_fits(job: Job, nodes: list[Node]) -> str | None:
    """Why ``job`` could not run even on the empty cluster (refuse it at submit), or ``None``.

    Checked against every node at full capacity with the same placement code the cycle uses, so a
    job that is accepted can start once enough work has finished.
    """
    allowed = [n for n in nodes if not n.inference_pool or job.priority is Priority.PRODUCTION_INFERENCE]
    empty = CapacityIndex(allowed, {})
    if empty.place(job, commit=False) is not None:
        return None
    where = {
        Placement.SAME_NODE: "one node",
        Placement.SAME_GROUP: "one node group",
        Placement.ANY: "the cluster",
    }[job.placement]
    kind = f" {job.gpu_type}" if job.gpu_type else ""
    return f"asks {job.gpus}{kind} GPUs in {where}; the largest there is {empty.largest_block(job)}"


def _lex_order(keys: list[np.ndarray], ids: list[str]) -> list[int]:
    """Indices sorting by ``keys`` (most significant first), then by id where every key ties.

    1. A stable lexicographic sort of the numeric keys in C.
    2. The runs where all keys tie (rare) are re-sorted by job id, so the order never depends on
       the order the snapshot listed the jobs in.
    """
    if not ids:
        return []
    # 1. numeric keys (np.lexsort takes the most significant last)
    order = np.lexsort(keys[::-1])
    tied = np.ones(len(ids) - 1, dtype=bool)
    for key in keys:
        ranked = key[order]
        tied &= ranked[1:] == ranked[:-1]
    result: list[int] = order.tolist()
    # 2. ties by id: a run spans positions start..end where tied[start:end] are all True
    if tied.any():
        edges = np.flatnonzero(np.diff(np.concatenate(([False], tied, [False])).astype(np.int8)))
        for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            result[start : end + 1] = sorted(result[start : end + 1], key=ids.__getitem__)
    return result
