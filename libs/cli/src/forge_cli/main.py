"""The ``forge`` command: ``up``, ``down``, ``status`` here; everything else from service plugins."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console

from forge_cli import data, local, platform
from forge_cli.plugins import PluginGroup
from forge_cli.supervisor import Paths

app = typer.Typer(
    cls=PluginGroup,
    help="Forge: schedule, train, evaluate and serve models on a shared cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
app.add_typer(data.app, name="data")

ServicesOption = Annotated[
    str | None,
    typer.Option(
        "--services",
        help="Comma-separated subset of services (default: all in the platform table; '' for none).",
    ),
]


def _specs(services: str | None) -> tuple[platform.ServiceSpec, ...]:
    try:
        return platform.select(None if services is None else services.split(","))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--services") from None


@app.command()
def up(
    services: ServicesOption = None,
    main_job: Annotated[
        bool, typer.Option(help="Run the platform's main job once everything is healthy.")
    ] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each service's health checks.")] = (
        local.SERVICE_TIMEOUT_S
    ),
) -> None:
    """Start the broker, Temporal and every service (only what is not running), then run the main job."""
    paths = Paths(local.find_root())
    specs = _specs(services)
    code = asyncio.run(
        local.up(
            paths, specs, console, run_main_job=main_job, timeout_s=timeout, infra=platform.Infra.from_env()
        )
    )
    raise typer.Exit(code)


@app.command()
def down() -> None:
    """Stop every process `forge up` started (services, Temporal, the broker); leave none behind."""
    raise typer.Exit(local.down(Paths(local.find_root()), console))


@app.command()
def status(
    services: ServicesOption = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless every component is healthy.")] = False,
) -> None:
    """Show each component's pid, whether it is alive and whether its health checks pass."""
    paths = Paths(local.find_root())
    code = asyncio.run(local.status(paths, _specs(services), console, infra=platform.Infra.from_env()))
    raise typer.Exit(code if check else 0)
