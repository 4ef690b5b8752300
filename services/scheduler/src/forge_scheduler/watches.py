"""Job watches: every committed change of a job reaches the watchers that want it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import sqlalchemy as sa

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.grpckit import current_principal
from forge_scheduler.store import JobRow


@dataclass
class _Watcher:
    team: str
    job_ids: frozenset[str]
    queue: asyncio.Queue[JobRow | None] = field(default_factory=lambda: asyncio.Queue(maxsize=1000))

    def wants(self, job: JobRow) -> bool:
        return (not self.team or job.team == self.team) and (not self.job_ids or job.id in self.job_ids)


def visible_team(team: str) -> str:
    """The team filter a read may use: a team token reads its own team's jobs only (an empty
    filter means its team; another team's is PERMISSION_DENIED); an admin any team, or all."""
    principal = current_principal()
    if principal is None or principal.is_admin:
        return team
    if team and team != principal.team:
        raise errors.PermissionDeniedError(f"{principal.name} may not read jobs of team {team!r}")
    return principal.team


class Watches:
    """Job watches: a collaborator of :class:`~forge_scheduler.service.SchedulerService` (its
    ``watches``), told of every committed change (:meth:`committed`, which calls ``on_commit``
    first); a watcher's queue holds ``queue_size`` changes."""

    def __init__(self, db: Database, on_commit: Callable[[], None], queue_size: int = 1000) -> None:
        self._db = db
        self._on_commit = on_commit
        self._queue_size = queue_size
        self._watchers: list[_Watcher] = []

    async def watch(self, team: str, job_ids: Iterable[str], send_initial: bool) -> AsyncIterator[JobRow]:
        """Yield matching jobs after every committed change; a watcher too slow to keep up is
        dropped with RESOURCE_EXHAUSTED rather than letting its queue grow without bound."""
        team = visible_team(team)
        watcher = _Watcher(team=team, job_ids=frozenset(job_ids), queue=asyncio.Queue(self._queue_size))
        self._watchers.append(watcher)
        try:
            if send_initial:
                query = sa.select(JobRow)
                if team:
                    query = query.where(JobRow.team == team)
                if watcher.job_ids:
                    query = query.where(JobRow.id.in_(watcher.job_ids))
                async with self._db.session() as session:
                    for job in (await session.scalars(query.order_by(JobRow.created_at))).all():
                        yield job
            while True:
                update = await watcher.queue.get()
                if update is None:
                    raise errors.OverloadedError("watch stream fell behind; reconnect with send_initial")
                yield update
        finally:
            self._watchers.remove(watcher)

    def committed(self, job: JobRow) -> None:
        self._on_commit()
        for watcher in list(self._watchers):
            if not watcher.wants(job):
                continue
            try:
                watcher.queue.put_nowait(job)
            except asyncio.QueueFull:
                while not watcher.queue.empty():
                    watcher.queue.get_nowait()
                watcher.queue.put_nowait(None)
