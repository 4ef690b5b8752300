"""The per-cycle quota book: GPUs in use per team and type, guarantees, borrowing in a cohort."""

from __future__ import annotations

from collections.abc import Mapping

from forge_scheduler.policy.capacity import Slots
from forge_scheduler.policy.model import ANY_GPU_TYPE, Job, Node, Priority, Team


class QuotaBook:
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
        if need == 0:
            return True, False, ""  # a job without GPUs asks for no quota
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
