"""The reward-model registry: immutable versions with what they were trained on and how well
they did, and the one thing that changes, their status.

A version records its checkpoint location (``uri``), the training snapshot it was trained on
(the ``snapshot_id`` of ``forge feedback export``), its backbone, and its held-out pairwise
accuracy with the 95 % interval (and how the interval was computed). Registering the same
``name:version`` twice is refused; there is no update path but :meth:`RewardModelRegistry.set_status`,
which moves a version between ``candidate``, ``active`` and ``retired`` and remembers who did it.
Who may call what (admins only for registration and status) is checked by the callers: the
gRPC servicer and the web routes.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from forge_kit import errors
from forge_kit.db import Database
from forge_preference_feedback.store import RewardModelRow, utcnow

STATUSES = ("candidate", "active", "retired")
INTERVALS = ("wilson", "bootstrap")
#: Versions that name another version: the newest registered, and the active one.
LATEST, ACTIVE = "latest", "active"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SNAPSHOT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class HeldoutAccuracy:
    """Pairwise accuracy on held-out pairs with its 95 % interval (``interval`` says how)."""

    accuracy: float
    ci95_low: float
    ci95_high: float
    n: int
    interval: str = "wilson"

    def check(self, field: str = "heldout") -> None:
        """Raise ValidationError naming the first bad field."""
        for name in ("accuracy", "ci95_low", "ci95_high"):
            value = getattr(self, name)
            if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise errors.ValidationError(f"{field}.{name}", "must be between 0 and 1")
        if not self.ci95_low <= self.accuracy <= self.ci95_high:
            raise errors.ValidationError(f"{field}.ci95_low", "the interval must contain the accuracy")
        if self.n < 1:
            raise errors.ValidationError(f"{field}.n", "must be at least 1 pair")
        if self.interval not in INTERVALS:
            raise errors.ValidationError(f"{field}.interval", f"must be one of {', '.join(INTERVALS)}")


def heldout_of(row: RewardModelRow) -> HeldoutAccuracy | None:
    """The held-out figures of a version (None for versions registered before they were kept)."""
    if row.heldout_accuracy is None or row.heldout_n is None:
        return None
    return HeldoutAccuracy(
        row.heldout_accuracy,
        row.heldout_ci95_low if row.heldout_ci95_low is not None else float("nan"),
        row.heldout_ci95_high if row.heldout_ci95_high is not None else float("nan"),
        row.heldout_n,
        row.heldout_interval,
    )


def _check_name(name: str) -> None:
    if not name:
        raise errors.ValidationError("ref.name", "must not be empty")
    if not _NAME.match(name):
        raise errors.ValidationError(
            "ref.name", "must be letters, digits, '.', '_' or '-', at most 128 characters"
        )


class RewardModelRegistry:
    """Reward-model versions in the feedback database; every method is one transaction."""

    def __init__(self, db: Database, *, clock: Callable[[], dt.datetime] = utcnow) -> None:
        self._db = db
        self._clock = clock

    async def register(
        self,
        name: str,
        version: str,
        *,
        uri: str,
        snapshot_id: str,
        backbone: str,
        heldout: HeldoutAccuracy,
        metrics: Mapping[str, float] | None = None,
        registered_by: str,
    ) -> RewardModelRow:
        """Add an immutable version (status ``candidate``); an empty version takes the next integer."""
        _check_name(name)
        if version in (LATEST, ACTIVE):
            raise errors.ValidationError("ref.version", f"{version!r} is reserved (it names another version)")
        if version and not _VERSION.match(version):
            raise errors.ValidationError(
                "ref.version", "must be letters, digits, '.', '_' or '-', at most 64 characters"
            )
        if not uri.strip():
            raise errors.ValidationError("uri", "must not be empty")
        if not snapshot_id:
            raise errors.ValidationError(
                "snapshot_id", "must not be empty: which training snapshot was it trained on?"
            )
        if not _SNAPSHOT.match(snapshot_id):
            raise errors.ValidationError(
                "snapshot_id", "must be letters, digits, '.', '_', ':' or '-', at most 128 characters"
            )
        if not backbone.strip() or len(backbone) > 255:
            raise errors.ValidationError("backbone", "must be 1 to 255 characters")
        heldout.check()
        metrics = dict(metrics or {})
        for key, value in metrics.items():
            if not key:
                raise errors.ValidationError("metrics", "names must not be empty")
            if not math.isfinite(value):
                raise errors.ValidationError(f"metrics.{key}", "must be finite")
        async with self._db.session() as session:
            if not version:
                existing = (
                    await session.scalars(
                        sa.select(RewardModelRow.version).where(RewardModelRow.name == name)
                    )
                ).all()
                version = str(max((int(v) for v in existing if v.isdigit()), default=0) + 1)
            elif await session.get(RewardModelRow, (name, version)) is not None:
                raise errors.AlreadyExistsError(
                    f"reward model {name}:{version} is already registered; versions are immutable"
                )
            row = RewardModelRow(
                name=name,
                version=version,
                uri=uri,
                metrics=metrics,
                created_at=self._clock(),
                status="candidate",
                snapshot_id=snapshot_id,
                backbone=backbone.strip(),
                heldout_accuracy=heldout.accuracy,
                heldout_ci95_low=heldout.ci95_low,
                heldout_ci95_high=heldout.ci95_high,
                heldout_n=heldout.n,
                heldout_interval=heldout.interval,
                registered_by=registered_by,
                status_changed_at=None,
                status_changed_by="",
            )
            session.add(row)
        return row

    async def get(self, name: str, version: str) -> RewardModelRow:
        """One version; ``latest`` is the newest registered and ``active`` the active one (of any
        name when ``name`` is empty)."""
        if name:
            _check_name(name)
        elif version not in (LATEST, ACTIVE):
            raise errors.ValidationError(
                "ref.name", f"must not be empty unless the version is {LATEST!r} or {ACTIVE!r}"
            )
        if not version:
            raise errors.ValidationError(
                "ref.version", f"must not be empty (a version, {LATEST!r} or {ACTIVE!r})"
            )
        query = sa.select(RewardModelRow)
        if name:
            query = query.where(RewardModelRow.name == name)
        if version == ACTIVE:
            query = query.where(RewardModelRow.status == "active")
        elif version != LATEST:
            query = query.where(RewardModelRow.version == version)
        order = (RewardModelRow.created_at.desc(), RewardModelRow.name, RewardModelRow.version.desc())
        async with self._db.session() as session:
            row = await session.scalar(query.order_by(*order).limit(1))
        if row is None:
            what = f"{name or 'any name'}:{version}"
            raise errors.NotFoundError(f"no reward model {what}")
        return row

    async def list(self, name: str, page_size: int, offset: int) -> tuple[list[RewardModelRow], int]:
        """Versions (of ``name``, or all), newest first, and how many there are."""
        query = sa.select(RewardModelRow)
        if name:
            query = query.where(RewardModelRow.name == name)
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(
                    query.order_by(
                        RewardModelRow.created_at.desc(), RewardModelRow.name, RewardModelRow.version.desc()
                    )
                    .offset(offset)
                    .limit(page_size)
                )
            ).all()
        return list(rows), total

    async def set_status(self, name: str, version: str, status: str, *, changed_by: str) -> RewardModelRow:
        """Move a version between candidate, active and retired. Making one version active retires
        the previously active version of that name, so ``active`` names one model."""
        if status not in STATUSES:
            raise errors.ValidationError("status", f"must be one of {', '.join(STATUSES)}")
        now = self._clock()
        async with self._db.session() as session:
            row = await session.get(RewardModelRow, (name, version))
            if row is None:
                raise errors.NotFoundError(f"reward model {name}:{version} not found")
            if status == "active":
                await session.execute(
                    sa.update(RewardModelRow)
                    .where(
                        RewardModelRow.name == name,
                        RewardModelRow.status == "active",
                        RewardModelRow.version != version,
                    )
                    .values(status="retired", status_changed_at=now, status_changed_by=changed_by)
                )
            if row.status != status:
                row.status, row.status_changed_at, row.status_changed_by = status, now, changed_by
        return row
