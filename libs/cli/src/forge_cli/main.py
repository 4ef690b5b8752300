"""The ``forge`` command: ``up``, ``down``, ``status`` here; everything else from service plugins."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console

from forge_cli import data, keys, local, platform, profiles
from forge_cli.plugins import PluginGroup
from forge_cli.supervisor import Paths
from forge_kit import clitools

app = typer.Typer(
    cls=PluginGroup,
    help="Forge: schedule, train, evaluate and serve models on a shared cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
app.add_typer(data.app, name="data")
app.add_typer(keys.app, name="keys")
app.add_typer(
    typer.Typer(
        cls=clitools.EntryPointGroup,
        help="Benchmarks: one a package declares in the entry-point group forge.bench.",
        no_args_is_help=True,
    ),
    name="bench",
)

ServicesOption = Annotated[
    str | None,
    typer.Option(
        "--services",
        help="Comma-separated subset of services (default: all in the platform table; '' for none).",
    ),
]


ProfileOption = Annotated[
    str,
    typer.Option(
        "--profile",
        help="dev: embedded stand-ins (make up). prod-like: PostgreSQL, Redis and the Qdrant backend, "
        "with the environment the Compose file sets; state under var/prod-like, ports +100.",
    ),
]


def _profile(name: str) -> profiles.Profile:
    try:
        return profiles.resolve(name, local.find_root())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--profile") from None


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
    profile: ProfileOption = "dev",
) -> None:
    """Start the broker, Temporal and every service (only what is not running), then run the main job."""
    chosen = _profile(profile)
    specs = _specs(services)
    code = asyncio.run(
        local.up(Paths(chosen.root), specs, console, run_main_job=main_job, timeout_s=timeout, profile=chosen)
    )
    raise typer.Exit(code)


@app.command()
def down(profile: ProfileOption = "dev") -> None:
    """Stop every process `forge up` started (services, Temporal, the broker); leave none behind."""
    raise typer.Exit(local.down(Paths(_profile(profile).root), console))


@app.command()
def status(
    services: ServicesOption = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless every component is healthy.")] = False,
    profile: ProfileOption = "dev",
) -> None:
    """Show each component's pid, whether it is alive and whether its health checks pass."""
    chosen = _profile(profile)
    specs = chosen.table(_specs(services))
    code = asyncio.run(local.status(Paths(chosen.root), specs, console, infra=chosen.infra))
    raise typer.Exit(code if check else 0)
