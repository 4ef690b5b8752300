"""What the collected preferences add up to: rater quality over every answer, accepted-pair
counts (in all, since a time, within a batch of queued comparisons) and training snapshots. Part
of :class:`~forge_preference_feedback.service.FeedbackService` (its :class:`PreferenceData` base).
"""

from __future__ import annotations

import datetime as dt
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from forge.common.v1 import common_pb2

from forge_kit.db import Database
from forge_preference_feedback.export import RatedPair, SnapshotManifest, write_snapshot
from forge_preference_feedback.quality import Label, QualityPolicy, QualityReport, assess_raters
from forge_preference_feedback.store import ComparisonRow, PreferenceRow

Choice = common_pb2.PreferenceChoice
# Quality labels: the proto's choices A, B, TIE, BOTH_BAD as 0..3.
QUALITY_CLASSES = 4
_GOLD = {"A": Choice.PREFERENCE_CHOICE_A, "B": Choice.PREFERENCE_CHOICE_B}


@dataclass(frozen=True)
class BatchStats:
    """Answers to the comparisons of one batch (an online round's queue): ``accepted`` pairs and
    the ``raters`` who gave them (A or B answers of raters rater quality does not flag), ``answers``
    of any kind."""

    comparisons: int = 0
    accepted: int = 0
    answers: int = 0
    raters: int = 0


@dataclass(frozen=True)
class PreferenceStats:
    """Accepted pairs (A or B answers of raters not flagged): in all and recorded after ``since``."""

    accepted: int
    accepted_since: int
    last_recorded_at: dt.datetime | None
    excluded_raters: dict[str, list[str]]
    batch: BatchStats = BatchStats()


@dataclass(frozen=True)
class StoredSnapshot:
    """A snapshot in the snapshot folder: where it is, what it holds, and whether this call wrote it."""

    path: Path
    manifest: SnapshotManifest
    created: bool


@dataclass(frozen=True)
class OriginCount:
    """Comparisons of one origin and batch, and the answers they got (the admin page's table)."""

    origin: str
    batch: str
    comparisons: int
    answers: int


class PreferenceData:
    """Rater quality, pair counts and snapshots; ``_db`` is set by ``FeedbackService.__init__``."""

    _db: Database

    async def comparison_origins(self, limit: int = 100) -> list[OriginCount]:
        """Comparisons by origin (``seed``, ``policy``, ``shadow``) and batch, newest batch first.
        For admins: raters are never told where an item comes from."""
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(
                        ComparisonRow.origin,
                        ComparisonRow.batch,
                        sa.func.count(),
                        sa.func.coalesce(sa.func.sum(ComparisonRow.answer_count), 0),
                    )
                    .group_by(ComparisonRow.origin, ComparisonRow.batch)
                    .order_by(sa.func.max(ComparisonRow.seq).desc())
                    .limit(limit)
                )
            ).all()
        return [OriginCount(o, b, int(n), int(a)) for o, b, n, a in rows]

    async def list_comparisons(
        self, *, origin: str = "", batch: str = "", limit: int = 50, offset: int = 0
    ) -> list[ComparisonRow]:
        """Comparisons in queue order, optionally of one origin and batch (admins' view)."""
        query = sa.select(ComparisonRow).order_by(ComparisonRow.seq).limit(limit).offset(offset)
        if origin:
            query = query.where(ComparisonRow.origin == origin)
        if batch:
            query = query.where(ComparisonRow.batch == batch)
        async with self._db.session() as session:
            return list((await session.scalars(query)).all())

    async def rater_quality(self, policy: QualityPolicy = QualityPolicy()) -> QualityReport:
        """Quality of every rater over all preferences recorded so far (see :mod:`.quality`)."""
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(
                        PreferenceRow.comparison_id,
                        PreferenceRow.rater_id,
                        PreferenceRow.choice,
                        PreferenceRow.created_at,
                        PreferenceRow.shown_at,
                    )
                )
            ).all()
            golds = (
                await session.execute(
                    sa.select(ComparisonRow.id, ComparisonRow.gold_choice).where(
                        ComparisonRow.id.in_({r.comparison_id for r in rows}), ComparisonRow.gold_choice != ""
                    )
                )
            ).all()
        labels = [
            Label(
                r.comparison_id,
                r.rater_id,
                r.choice - 1,
                (r.created_at - r.shown_at).total_seconds() if r.shown_at else float("nan"),
            )
            for r in rows
        ]
        gold = {g.id: _GOLD[g.gold_choice] - 1 for g in golds if g.gold_choice in _GOLD}
        return assess_raters(labels, QUALITY_CLASSES, gold, policy)

    async def preference_stats(
        self,
        since: dt.datetime | None = None,
        policy: QualityPolicy = QualityPolicy(),
        *,
        batch: str = "",
    ) -> PreferenceStats:
        """How many accepted pairs there are, and how many were recorded after ``since``: the
        pairs a snapshot would hold (flagged raters' labels, ties and "both bad" left out). With
        ``batch``, also the answers to that batch's comparisons (what an online round waits on)."""
        report = await self.rater_quality(policy)
        flagged = report.flagged()
        accepted: list[sa.ColumnElement[bool]] = [
            PreferenceRow.choice.in_([Choice.PREFERENCE_CHOICE_A, Choice.PREFERENCE_CHOICE_B])
        ]
        if flagged:
            accepted.append(PreferenceRow.rater_id.not_in(list(flagged)))
        newer = PreferenceRow.created_at > since if since is not None else sa.false()
        async with self._db.session() as session:
            total, fresh, last = (
                await session.execute(
                    sa.select(
                        sa.func.count(),
                        sa.func.coalesce(sa.func.sum(sa.case((newer, 1), else_=0)), 0),
                        sa.func.max(PreferenceRow.created_at),
                    ).where(*accepted)
                )
            ).one()
            in_batch = BatchStats()
            if batch:
                ours = sa.select(ComparisonRow.id).where(ComparisonRow.batch == batch)
                comparisons = int(
                    await session.scalar(sa.select(sa.func.count()).select_from(ours.subquery())) or 0
                )
                mine = PreferenceRow.comparison_id.in_(ours)
                answers, raters, good = (
                    await session.execute(
                        sa.select(
                            sa.func.count(),
                            sa.func.count(sa.distinct(sa.case((sa.and_(*accepted), PreferenceRow.rater_id)))),
                            sa.func.coalesce(sa.func.sum(sa.case((sa.and_(*accepted), 1), else_=0)), 0),
                        ).where(mine)
                    )
                ).one()
                in_batch = BatchStats(comparisons, int(good), int(answers), int(raters))
        return PreferenceStats(int(total), int(fresh), last, flagged, in_batch)

    async def export_to_store(
        self, root: Path, *, heldout_fraction: float = 0.1, policy: QualityPolicy = QualityPolicy()
    ) -> StoredSnapshot:
        """Export a snapshot into ``root/<snapshot id>``. The id is a digest of the data, so the
        same data is one folder: a snapshot already there is returned (``created`` False) and the
        fresh copy discarded; a folder is never overwritten."""
        root.mkdir(parents=True, exist_ok=True)
        pending = root / f".pending-{uuid.uuid4().hex}"
        manifest = await self.export_snapshot(pending, heldout_fraction=heldout_fraction, policy=policy)
        final = root / manifest.snapshot_id
        try:
            pending.rename(final)
        except OSError:  # the same data was exported before: keep the first copy
            if not (final / "manifest.json").is_file():
                raise
            shutil.rmtree(pending, ignore_errors=True)
            return StoredSnapshot(final, manifest, created=False)
        return StoredSnapshot(final, manifest, created=True)

    async def export_snapshot(
        self, out: Path, *, heldout_fraction: float = 0.1, policy: QualityPolicy = QualityPolicy()
    ) -> SnapshotManifest:
        """Write the accepted A/B pairs as a training snapshot (see :mod:`.export`).

        1. Assess the raters; flagged raters' labels are excluded, with the reasons in the manifest.
        2. Ties and "both bad" carry no preference between the two responses and are left out
           (counted). 3. Everything else is written with its rater's weight.
        """
        # 1.
        report = await self.rater_quality(policy)
        excluded_raters = report.flagged()
        weights = {q.rater: q.weight for q in report.raters}
        # 2-3.
        excluded: Counter[str] = Counter()
        pairs: list[RatedPair] = []
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(PreferenceRow, ComparisonRow)
                    .join(ComparisonRow, ComparisonRow.id == PreferenceRow.comparison_id)
                    .order_by(PreferenceRow.created_at, PreferenceRow.id)
                )
            ).all()
        for pref, comparison in rows:
            if pref.choice not in (Choice.PREFERENCE_CHOICE_A, Choice.PREFERENCE_CHOICE_B):
                excluded["tie_or_both_bad"] += 1
                continue
            a, b = comparison.response_a_text, comparison.response_b_text
            chosen, rejected = (a, b) if pref.choice == Choice.PREFERENCE_CHOICE_A else (b, a)
            pairs.append(
                RatedPair(
                    pref.id,
                    comparison.id,
                    pref.rater_id,
                    comparison.prompt,
                    chosen,
                    rejected,
                    pref.created_at.isoformat(),
                )
            )
        return write_snapshot(
            pairs,
            out,
            heldout_fraction=heldout_fraction,
            excluded_raters=excluded_raters,
            excluded=excluded,
            weights=weights,
        )
