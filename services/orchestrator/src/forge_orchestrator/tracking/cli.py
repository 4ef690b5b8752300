"""``forge runs …``: list and compare the training runs tracked in MLflow.

The tracking server is ``$FORGE_CLI_MLFLOW_URI`` (default ``http://127.0.0.1:8060``, where
``forge up`` runs it). ``list`` filters by recipe, sweep and any ``--tag k=v``; ``compare`` puts
the metrics of several runs side by side (each metric's latest value) and shows the params that
differ between them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar

import typer
from mlflow.exceptions import MlflowException
from rich.console import Console
from rich.table import Table

from forge_kit import clitools
from forge_orchestrator.tracking.tracker import (
    PARENT_TAG,
    TAG_JOB,
    TAG_RECIPE,
    TAG_SWEEP,
    TAG_TRIAL,
    RunFilter,
    TrackedRun,
    Tracker,
    differing_params,
)

DEFAULT_URI = "http://127.0.0.1:8060"
MAX_COMPARE = 20

app = typer.Typer(help="List and compare training runs tracked in MLflow.", no_args_is_help=True)
console = Console()
T = TypeVar("T")

UriOption = Annotated[
    str, typer.Option("--mlflow-uri", envvar="FORGE_CLI_MLFLOW_URI", help="MLflow tracking server URL.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _call(fn: Callable[[], T], uri: str) -> T:
    """Run an MLflow call; an unreachable server or a refused request is one red line, exit 1."""
    try:
        return fn()
    except MlflowException as exc:
        console.print(f"[red]MLflow at {uri}[/]: {exc.message[:300]}", highlight=False)
        raise typer.Exit(1) from None
    except OSError as exc:
        console.print(f"[red]MLflow at {uri} unreachable[/]: {exc}", highlight=False)
        raise typer.Exit(1) from None


def tracker_for(uri: str) -> Tracker:
    """A client that gives up on an unreachable server within seconds (MLflow's own default is
    to retry for minutes, right for a service, not for a command someone waits on)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        return Tracker(uri)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mlflow-uri") from None


def parse_tags(pairs: list[str]) -> dict[str, str]:
    """``k=v`` pairs as a dict; a pair without ``=`` or with an empty side is refused, naming it."""
    tags: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value:
            raise typer.BadParameter(f"{pair!r} is not key=value", param_hint="--tag")
        tags[key.strip()] = value
    return tags


def run_row(run: TrackedRun) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "name": run.name,
        "status": run.status,
        "recipe": run.tags.get(TAG_RECIPE, ""),
        "job_id": run.tags.get(TAG_JOB, ""),
        "sweep_id": run.tags.get(TAG_SWEEP, ""),
        "trial": run.tags.get(TAG_TRIAL, ""),
        "parent_run_id": run.tags.get(PARENT_TAG, ""),
        "loss": run.metrics.get("loss", ""),
        "url": run.url,
    }


@app.command("list")
def list_runs(
    recipe: Annotated[str, typer.Option("--recipe", help="Only runs of this recipe.")] = "",
    sweep: Annotated[str, typer.Option("--sweep", help="Only the runs of this sweep (and its parent).")] = "",
    tag: Annotated[
        list[str] | None, typer.Option("--tag", help="Only runs with tag k=v (repeatable).")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="At most this many runs.")] = 50,
    mlflow_uri: UriOption = DEFAULT_URI,
    as_json: JsonOption = False,
) -> None:
    """Tracked runs, newest first."""
    try:
        run_filter = RunFilter(recipe=recipe, sweep_id=sweep, tags=parse_tags(tag or []))
        run_filter.to_mlflow()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    tracker = tracker_for(mlflow_uri)
    runs = _call(lambda: tracker.find_runs(run_filter, max_results=limit), mlflow_uri)
    columns = ["run_id", "name", "status", "recipe", "sweep_id", "trial", "loss", "url"]
    clitools.show_rows([run_row(r) for r in runs], columns, as_json, title=f"{len(runs)} run(s)")


def comparison(runs: list[TrackedRun]) -> dict[str, Any]:
    """Metrics side by side (latest values) and the params that differ, for ``compare``."""
    metric_names = sorted({m for r in runs for m in r.metrics})
    return {
        "runs": [{"run_id": r.run_id, "name": r.name, "url": r.url} for r in runs],
        "metrics": {m: [r.metrics.get(m) for r in runs] for m in metric_names},
        "params_differing": differing_params(runs),
    }


@app.command()
def compare(
    run_ids: Annotated[list[str], typer.Argument(help="Two or more MLflow run ids.")],
    mlflow_uri: UriOption = DEFAULT_URI,
    as_json: JsonOption = False,
) -> None:
    """Metrics of the runs side by side, and the params that differ between them."""
    if not 2 <= len(run_ids) <= MAX_COMPARE:
        raise typer.BadParameter(f"give 2 to {MAX_COMPARE} run ids, got {len(run_ids)}", param_hint="RUN_IDS")
    for run_id in run_ids:
        if not run_id.isalnum() or len(run_id) > 64:
            raise typer.BadParameter(f"{run_id[:70]!r} is not an MLflow run id", param_hint="RUN_IDS")
    tracker = tracker_for(mlflow_uri)
    runs = [_call(partial(tracker.get_run, run_id), mlflow_uri) for run_id in run_ids]
    result = comparison(runs)
    if as_json:
        clitools.show_record(result, True)
        return
    header = [r.name or r.run_id[:8] for r in runs]
    metrics = Table(title="metrics (latest value)")
    metrics.add_column("metric", style="bold")
    for name in header:
        metrics.add_column(name)
    for metric, values in result["metrics"].items():
        metrics.add_row(metric, *("" if v is None else f"{v:.6g}" for v in values))
    console.print(metrics)
    params = Table(title="params that differ")
    params.add_column("param", style="bold")
    for name in header:
        params.add_column(name)
    for param, values in result["params_differing"].items():
        params.add_row(param, *values)
    console.print(params if result["params_differing"] else "no params differ")
    for r in runs:
        console.print(f"{r.name or r.run_id}: {r.url}", highlight=False)
