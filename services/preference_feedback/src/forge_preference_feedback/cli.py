"""``forge feedback …``: seed comparisons into the preference feedback database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from forge_kit.db import Database
from forge_preference_feedback.config import FeedbackSettings
from forge_preference_feedback.seeds import ReadStats, read_hh_rlhf, resolve_data_path
from forge_preference_feedback.service import FeedbackService, SeedResult

app = typer.Typer(help="Preference feedback: comparisons for raters.", no_args_is_help=True)
MIGRATIONS = Path(__file__).parent / "migrations"
DEFAULT_SOURCE = "../shared/data/preferences/hh-rlhf"


async def _seed(database_url: str, source: Path, limit: int, rng_seed: int, stats: ReadStats) -> SeedResult:
    db = Database(database_url)
    try:
        await db.migrate(MIGRATIONS)
        return await FeedbackService(db).seed_comparisons(
            read_hh_rlhf(source, stats), limit=limit, rng_seed=rng_seed
        )
    finally:
        await db.dispose()


@app.callback()
def main() -> None:
    """Preference feedback commands."""


@app.command()
def seed(
    limit: int = typer.Option(
        200, "--limit", "-n", min=1, help="Comparisons to load (pairs seeded before count)."
    ),
    source: str = typer.Option(
        "", "--dir", help=f"HH-RLHF folder; default: the seed_dir setting, else {DEFAULT_SOURCE}."
    ),
    data_dir: str = typer.Option(
        "var/data/preference_feedback",
        "--data-dir",
        help="The service's data folder (where `forge up` keeps it).",
    ),
    database_url: str = typer.Option("", "--database-url", help="Database URL; overrides --data-dir."),
    rng_seed: int = typer.Option(0, "--rng-seed", help="Seed of the A/B order randomisation."),
) -> None:
    """Load comparisons from real HH-RLHF pairs into the service's database (idempotent)."""
    settings = FeedbackSettings(data_dir=data_dir, database_url=database_url)
    folder = resolve_data_path(source or settings.seed_dir or DEFAULT_SOURCE)
    stats = ReadStats()
    try:
        result = asyncio.run(
            _seed(settings.sqlite_url("preference_feedback.db"), folder, limit, rng_seed, stats)
        )
    except FileNotFoundError as exc:
        typer.echo(f"forge feedback seed: {exc}", err=True)
        raise typer.Exit(2) from exc
    table = Table(title=f"Seeded from {folder}")
    table.add_column("comparisons")
    table.add_column("count", justify="right")
    table.add_row("added", str(result.added))
    table.add_row("already present", str(result.already_present))
    for reason, count in sorted(stats.skipped.items()):
        table.add_row(f"skipped: {reason}", str(count))
    Console().print(table)
