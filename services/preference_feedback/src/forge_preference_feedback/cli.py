"""``forge feedback …``: seed comparisons, add rater accounts, export training snapshots."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import typer
from rich.console import Console
from rich.table import Table

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.paths import resolve_data_path
from forge_preference_feedback.config import FeedbackSettings
from forge_preference_feedback.seeds import ReadStats, read_hh_rlhf
from forge_preference_feedback.service import FeedbackService, SeedResult

app = typer.Typer(help="Preference feedback: comparisons for raters.", no_args_is_help=True)
MIGRATIONS = Path(__file__).parent / "migrations"
DEFAULT_SOURCE = "preferences/hh-rlhf"
PASSWORD_ENV = "FORGE_FEEDBACK_PASSWORD"
T = TypeVar("T")
DATA_DIR_OPTION = typer.Option(
    "var/data/preference_feedback",
    "--data-dir",
    help="The service's data folder (where `forge up` keeps it).",
)
DATABASE_URL_OPTION = typer.Option("", "--database-url", help="Database URL; overrides --data-dir.")


def _with_service(data_dir: str, database_url: str, action: Callable[[FeedbackService], Awaitable[T]]) -> T:
    settings = FeedbackSettings(data_dir=data_dir, database_url=database_url)

    async def run() -> T:
        db = Database(settings.sqlite_url("preference_feedback.db"))
        try:
            await db.migrate(MIGRATIONS)
            return await action(FeedbackService(db, overlap=settings.overlap_k))
        finally:
            await db.dispose()

    return asyncio.run(run())


async def seed_database(
    database_url: str, source: Path, limit: int, rng_seed: int, stats: ReadStats
) -> SeedResult:
    """Migrate the database at ``database_url`` and seed ``limit`` comparisons from ``source``."""
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
            seed_database(settings.sqlite_url("preference_feedback.db"), folder, limit, rng_seed, stats)
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


@app.command("add-rater")
def add_rater(
    rater_id: str = typer.Argument(..., help="Rater name (letters, digits, '.', '_', '@', '-')."),
    admin: bool = typer.Option(False, "--admin", help="May see rater statistics and change reward models."),
    data_dir: str = DATA_DIR_OPTION,
    database_url: str = DATABASE_URL_OPTION,
) -> None:
    """Create a rater account; the password comes from $FORGE_FEEDBACK_PASSWORD or a prompt."""
    password = os.environ.get(PASSWORD_ENV) or typer.prompt(
        "Password", hide_input=True, confirmation_prompt=True
    )
    try:
        _with_service(data_dir, database_url, lambda s: s.create_rater(rater_id, password, is_admin=admin))
    except (errors.ValidationError, errors.AlreadyExistsError) as exc:
        field = getattr(exc, "field", "")
        typer.echo(f"forge feedback add-rater: {field + ': ' if field else ''}{exc.message}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"rater {rater_id} added{' (admin)' if admin else ''}")


@app.command()
def export(
    out: Path = typer.Option(..., "--out", help="Snapshot folder to create (must not exist)."),
    heldout: float = typer.Option(0.1, "--heldout", min=0.0, max=0.99, help="Share of comparisons held out."),
    data_dir: str = DATA_DIR_OPTION,
    database_url: str = DATABASE_URL_OPTION,
) -> None:
    """Write accepted preference pairs (HH-RLHF format, flagged raters excluded) as a snapshot."""
    if out.exists():
        typer.echo(f"forge feedback export: --out {out} already exists; snapshots are immutable", err=True)
        raise typer.Exit(2)
    manifest = _with_service(
        data_dir, database_url, lambda s: s.export_snapshot(out, heldout_fraction=heldout)
    )
    typer.echo(json.dumps(asdict(manifest), indent=2, sort_keys=True))
