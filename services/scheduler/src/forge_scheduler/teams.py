"""Teams, their quotas and their tokens: the part of the scheduler's domain callers configure."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Callable, Iterable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.grpckit import Principal, require_admin
from forge_scheduler.records import QuotaSpec, TeamView
from forge_scheduler.store import QuotaRow, TeamRow, TeamTokenRow
from forge_scheduler.validation import validate_name, validate_quota


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Teams:
    """Teams, quotas and team tokens: a collaborator of
    :class:`~forge_scheduler.service.SchedulerService` (its ``teams``). ``wake`` is called after a
    change that may let a job start (a quota set)."""

    def __init__(self, db: Database, clock: Callable[[], dt.datetime], wake: Callable[[], None]) -> None:
        self._db = db
        self._clock = clock
        self._wake = wake
        self._team_tokens: dict[str, str] = {}

    # --- team tokens -------------------------------------------------------------------------

    async def load_tokens(self) -> None:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(TeamTokenRow))).all()
        self._team_tokens = {row.token_hash: row.team for row in rows}

    def authenticate(self, token: str) -> Principal | None:
        """The kit's authenticator hook: a known team token acts for its team only."""
        team = self._team_tokens.get(token_hash(token))
        return None if team is None else Principal(name=f"team:{team}", role="team", team=team)

    async def issue_team_token(self, team: str, description: str) -> tuple[str, str]:
        """(token, token id). Only the hash is stored; the token is returned this once."""
        require_admin("IssueTeamToken")
        validate_name("team", team)
        if len(description) > 255:
            raise errors.ValidationError("description", "must be at most 255 characters")
        token = f"forge-team-{team}-{secrets.token_urlsafe(24)}"
        digest = token_hash(token)
        async with self._db.session() as session:
            if await session.get(TeamRow, team) is None:
                raise errors.NotFoundError(f"team {team!r} not found")
            session.add(
                TeamTokenRow(token_hash=digest, team=team, description=description, created_at=self._clock())
            )
        self._team_tokens[digest] = team
        return token, digest[:12]

    # --- teams -------------------------------------------------------------------------------

    async def create_team(
        self, name: str, display_name: str, quotas: Iterable[QuotaSpec], cohort: str = ""
    ) -> TeamView:
        require_admin("CreateTeam")
        validate_name("name", name)
        if cohort:
            validate_name("cohort", cohort)
        quotas = list(quotas)
        for i, quota in enumerate(quotas):
            validate_quota(f"quotas[{i}]", quota)
        async with self._db.session() as session:
            if await session.get(TeamRow, name) is not None:
                raise errors.AlreadyExistsError(f"team {name!r} already exists")
            session.add(
                TeamRow(
                    name=name,
                    display_name=display_name or name,
                    created_at=self._clock(),
                    cohort=cohort or "default",
                )
            )
            await session.flush()
            for quota in quotas:
                session.add(quota_row(name, quota))
        return await self.get_team(name)

    async def get_team(self, name: str) -> TeamView:
        async with self._db.session() as session:
            return await _team_view(session, name)

    async def list_teams(self, page_size: int, offset: int) -> tuple[list[TeamView], int]:
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(TeamRow)) or 0)
            names = (
                await session.scalars(
                    sa.select(TeamRow.name).order_by(TeamRow.name).offset(offset).limit(page_size)
                )
            ).all()
            return [await _team_view(session, n) for n in names], total

    async def set_quota(self, team: str, quota: QuotaSpec) -> TeamView:
        require_admin("SetQuota")
        validate_name("team", team)
        validate_quota("quota", quota)
        async with self._db.session() as session:
            if await session.get(TeamRow, team) is None:
                raise errors.NotFoundError(f"team {team!r} not found")
            existing = await session.get(QuotaRow, (team, quota.gpu_type))
            if existing is not None:
                await session.delete(existing)
                await session.flush()
            session.add(quota_row(team, quota))
        self._wake()
        return await self.get_team(team)


def quota_row(team: str, quota: QuotaSpec) -> QuotaRow:
    return QuotaRow(
        team=team,
        gpu_type=quota.gpu_type,
        guaranteed_gpus=quota.guaranteed_gpus,
        borrow_limit=quota.borrow_limit,
        weight=quota.weight or 1.0,
    )


async def _team_view(session: AsyncSession, name: str) -> TeamView:
    team = await session.get(TeamRow, name)
    if team is None:
        raise errors.NotFoundError(f"team {name!r} not found")
    quotas = (
        await session.scalars(sa.select(QuotaRow).where(QuotaRow.team == name).order_by(QuotaRow.gpu_type))
    ).all()
    return TeamView(
        name=team.name,
        display_name=team.display_name,
        created_at=team.created_at,
        quotas=tuple(quotas),
        cohort=team.cohort,
    )
