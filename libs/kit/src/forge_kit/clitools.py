"""Helpers for the ``forge <subcommand>`` apps that service packages contribute.

A subcommand finds its service at ``$FORGE_CLI_<SERVICE>_TARGET`` (or its ``--target``) and its
token in the file ``--token-file`` names, else at ``$FORGE_CLI_<SERVICE>_TOKEN``, else in
``var/secrets/tokens.json`` (written by ``forge up``) under ``$FORGE_ROOT`` or the nearest
directory above the working directory that has one; there is no default token. A token is never a
command-line value: every local user can read a process's arguments (``ps``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import typer
from rich.console import Console
from rich.table import Table

TOKEN_FILE = Path("var") / "secrets" / "tokens.json"
console = Console()
T = TypeVar("T")


def token_option(env: str, what: str, flag: str = "--token-file") -> Any:
    """A typer option naming a file that holds the token (``-``: standard input); its value, as
    the command receives it, is the token read from there, else ``$env``'s, else ``""``."""

    def read(value: str | None) -> str:
        if not value:
            return os.environ.get(env, "")
        try:
            text = typer.get_text_stream("stdin").read() if value == "-" else Path(value).read_text()
        except OSError as exc:
            raise typer.BadParameter(f"cannot read the token: {exc.strerror}", param_hint=flag) from None
        token = text.strip()
        if not token or "\n" in token:
            raise typer.BadParameter("the file must hold one token on one line", param_hint=flag)
        return token

    return typer.Option(
        flag,
        callback=read,
        metavar="FILE",
        show_default=False,
        help=f"File holding the {what} ('-': standard input); else ${env}.",
    )


def resolve_token(service: str, explicit: str = "", start: Path | None = None) -> str:
    """The explicit token, else the token file's entry for ``service``; neither is an error."""
    if explicit:
        return explicit
    roots = [Path(os.environ["FORGE_ROOT"])] if os.environ.get("FORGE_ROOT") else []
    here = (start or Path.cwd()).resolve()
    roots += [here, *here.parents]
    for root in roots:
        path = root / TOKEN_FILE
        if path.is_file():
            tokens = json.loads(path.read_text())
            if not isinstance(tokens, dict):
                raise typer.BadParameter(f"{path} is not a JSON object of service name to token")
            token = tokens.get(service)
            if isinstance(token, str) and token:
                return token
    raise typer.BadParameter(
        f"no token for {service}: pass --token, set FORGE_CLI_{service.upper()}_TOKEN, or run `forge up` "
        f"(it writes {TOKEN_FILE})"
    )


def run_rpc(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; a gRPC error becomes one red line and exit status 1, not a traceback."""
    try:
        return asyncio.run(coro)
    except grpc.aio.AioRpcError as exc:
        console.print(f"[red]{exc.code().name}[/]: {exc.details()}", highlight=False)
        raise typer.Exit(1) from None


def show_record(data: Mapping[str, Any], as_json: bool) -> None:
    """One record as a two-column table, or as JSON."""
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        return
    table = Table(show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in data.items():
        table.add_row(key, value if isinstance(value, str) else json.dumps(value, default=str))
    console.print(table)


def show_rows(rows: Sequence[Mapping[str, Any]], columns: list[str], as_json: bool, title: str = "") -> None:
    """Records as a table with ``columns``, or as a JSON list."""
    if as_json:
        typer.echo(json.dumps(rows, indent=2, sort_keys=True, default=str))
        return
    table = Table(title=title or None)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    console.print(table)
