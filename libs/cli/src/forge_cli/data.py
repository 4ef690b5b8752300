"""``forge data``: list the datasets the platform uses and fetch them into ``FORGE_DATA_DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn
from rich.table import Table

from forge_kit import datasets

app = typer.Typer(
    help="Datasets: list them, fetch them (checksums pinned) into FORGE_DATA_DIR.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)


@app.command("list")
def list_datasets() -> None:
    """Each dataset: its folder under the data dir, size, whether it is all present, licence."""
    root = datasets.data_dir()
    table = Table(title=f"datasets in {root}")
    for column in ("name", "folder", "bytes", "present", "license", "description"):
        table.add_column(column, overflow="fold")
    for ds in datasets.catalog().values():
        present = sum(datasets.is_present(ds, root, f) for f in ds.files)
        table.add_row(
            ds.name, ds.folder, f"{ds.size:,}", f"{present}/{len(ds.files)}", ds.license, ds.description
        )
    Console().print(table)


@app.command()
def fetch(
    names: Annotated[list[str] | None, typer.Argument(help="Datasets to fetch (default: all).")] = None,
    mirror: Annotated[
        Path | None,
        typer.Option("--from", help="Copy from this mirror folder (same layout) instead of downloading."),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Download each dataset from its public source (or copy it from a mirror), checking every
    file against its pinned sha256; files already in place are kept."""
    if mirror is not None and not mirror.is_dir():
        raise typer.BadParameter(f"{mirror} is not a folder", param_hint="--from")
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
        transient=True,
    )
    tasks: dict[str, TaskID] = {}

    def progress(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=total or None)
        bar.update(tasks[label], completed=done, total=total or None)

    try:
        with bar:
            lines = datasets.fetch(names or (), mirror=mirror, progress=progress)
    except datasets.DataError as exc:
        console.print(f"[red]forge data fetch[/]: {exc}", highlight=False)
        raise typer.Exit(1) from None
    for line in lines:
        typer.echo(line)
    typer.echo(f"data dir: {datasets.data_dir()}")
