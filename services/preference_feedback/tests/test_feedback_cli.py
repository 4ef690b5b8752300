"""`forge feedback seed` loads real comparisons into the service's database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import sqlalchemy as sa
from typer.testing import CliRunner

from forge_kit.db import Database
from forge_preference_feedback.cli import app
from forge_preference_feedback.store import ComparisonRow


def test_seed_command_loads_and_reports(tmp_path: Path, hh_root: Path) -> None:
    runner = CliRunner()
    args = ["seed", "--limit", "6", "--dir", str(hh_root), "--data-dir", str(tmp_path)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "added" in first.output and "6" in first.output
    second = runner.invoke(app, args)
    assert second.exit_code == 0 and "already present" in second.output

    async def rows() -> int:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'preference_feedback.db'}")
        try:
            async with db.session() as session:
                return int(await session.scalar(sa.select(sa.func.count()).select_from(ComparisonRow)) or 0)
        finally:
            await db.dispose()

    assert asyncio.run(rows()) == 6


def test_seed_command_reports_a_missing_folder(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["seed", "--dir", str(tmp_path / "nope"), "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "does not exist" in result.output
