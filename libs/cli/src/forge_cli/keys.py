"""``forge keys``: the secrets ``forge up`` generated for services' settings, shown on request.

``forge up`` never prints a generated secret (it would land in terminal scrollback and CI logs):
it keeps each in the secrets store (``var/secrets/generated.json``, mode 0600) and says where.
``forge keys list`` names them; ``forge keys show NAME`` prints one value alone on stdout, so
``forge keys show inference_gateway.BOOTSTRAP_API_KEY`` can feed a variable or a file.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from forge_cli import local
from forge_cli.supervisor import Paths

#: The gateway's first API key, the one a fresh platform's users start with.
BOOTSTRAP_KEY = "inference_gateway.BOOTSTRAP_API_KEY"

app = typer.Typer(
    help="Show the secrets forge up generated (kept in var/secrets, mode 0600).", no_args_is_help=True
)
console = Console(stderr=True)


def _generated() -> dict[str, str]:
    path = Paths(local.find_root()).generated
    if not path.exists():
        console.print(f"no generated secrets yet ({path} does not exist): run forge up first")
        raise typer.Exit(1)
    try:
        loaded = json.loads(path.read_text())
    except PermissionError:
        console.print(f"cannot read {path} (mode 0600): run this as the user who ran forge up")
        raise typer.Exit(1) from None
    if not isinstance(loaded, dict):
        console.print(f"{path} is not a JSON object")
        raise typer.Exit(1)
    return {str(k): str(v) for k, v in loaded.items()}


@app.command("list")
def list_keys() -> None:
    """Name every generated secret (not its value)."""
    for name in sorted(_generated()):
        typer.echo(name)


@app.command()
def show(
    name: Annotated[str, typer.Argument(help=f"The secret's name, e.g. {BOOTSTRAP_KEY}.")] = BOOTSTRAP_KEY,
) -> None:
    """Print one generated secret's value (the gateway's bootstrap API key by default)."""
    values = _generated()
    if name not in values:
        console.print(f"no generated secret {name!r}; known: {', '.join(sorted(values)) or 'none'}")
        raise typer.Exit(1)
    typer.echo(values[name])
