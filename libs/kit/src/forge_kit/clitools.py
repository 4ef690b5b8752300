"""Helpers for the ``forge <subcommand>`` apps that service packages contribute.

A subcommand finds its service at ``$FORGE_CLI_<SERVICE>_TARGET`` (or its ``--target``) and its
token in the file ``--token-file`` names, else at ``$FORGE_CLI_<SERVICE>_TOKEN``, else in
``var/secrets/tokens.json`` (written by ``forge up``) under ``$FORGE_ROOT`` or the nearest
directory above the working directory that has one; there is no default token. A token is never a
command-line value: every local user can read a process's arguments (``ps``).

Long-running commands show a :func:`progress` bar on stderr (off with ``--quiet`` or when stderr is
not a terminal, so JSON on stdout stays clean). An expected failure (a service that is not up, a
refused token, something not found, a wait that ran out) ends in one line from
:func:`describe_error` and a non-zero exit, never a traceback.

Benchmarks plug into ``forge bench`` through the entry-point group ``forge.bench``
(:class:`EntryPointGroup`): ``name = "package.module:function"`` in a package's pyproject.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from typer.core import TyperGroup

TOKEN_FILE = Path("var") / "secrets" / "tokens.json"
console = Console()
error_console = Console(stderr=True)
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


_RPC_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is the service up? (`forge status`; `--target` or $FORGE_CLI_<SERVICE>_TARGET)",
    grpc.StatusCode.UNAUTHENTICATED: "check the token (--token-file, $FORGE_CLI_<SERVICE>_TOKEN or var/secrets/tokens.json)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the service did not answer in time; it may be overloaded",
}


def describe_error(exc: BaseException) -> str | None:
    """One line for an expected failure (a service down or unreachable, a refused token, a
    resource not found, a wait that ran out); None for anything else, which is a bug to show."""
    if isinstance(exc, grpc.aio.AioRpcError):
        hint = _RPC_HINTS.get(exc.code())
        return f"{exc.code().name}: {exc.details()}" + (f" — {hint}" if hint else "")
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return f"cannot connect to {_url(exc)}: {exc} — is it running?"
    if isinstance(exc, httpx.TimeoutException):
        return f"{_url(exc)} did not answer in time"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.request.url} answered HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    if isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)
    ):
        return f"connection refused: {exc} — is the service up? (`forge status`)"
    if isinstance(exc, TimeoutError):
        return f"timed out: {exc}" if str(exc) else "timed out"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return None


def _url(exc: httpx.RequestError) -> str:
    try:
        return str(exc.request.url)
    except RuntimeError:  # raised outside a request: no URL attached
        return "the server"


def run_rpc(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; an expected error (gRPC status, connection refused, timeout) becomes one red
    line and exit status 1, not a traceback."""
    try:
        return asyncio.run(coro)
    except Exception as exc:
        message = describe_error(exc)
        if message is None:
            raise
        error_console.print(f"[red]error[/]: {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


QuietOption = typer.Option(
    "--quiet", "-q", help="No progress bar (it is off anyway when stderr is not a terminal)."
)


@contextmanager
def progress(quiet: bool = False) -> Iterator[Progress]:
    """A rich progress display on stderr; disabled with ``quiet`` or when stderr is not a TTY
    (its methods then do nothing), so piped output and JSON on stdout stay clean."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet or not sys.stderr.isatty(),
        transient=False,
    )
    with bar:
        yield bar


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


@contextmanager
def stages(total: int, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A :func:`progress` bar over ``total`` named stages: call ``start(name)`` as each begins;
    the bar shows the stage running and how many are done."""
    with progress(quiet) as bar:
        task = bar.add_task("starting", total=total)
        begun = 0

        def start(name: str) -> None:
            nonlocal begun
            if begun:
                bar.advance(task)
            begun += 1
            bar.update(task, description=name)

        yield start
        bar.update(task, completed=total, description="done")


BENCH_GROUP = "forge.bench"


def broken_command(name: str, ep: EntryPoint, exc: BaseException) -> Any:
    """A command standing for an entry point that failed to load: it says why and exits 1, so one
    broken plugin never takes the whole command (or its ``--help``) down."""
    message = f"cannot load {ep.value} ({ep.dist.name if ep.dist else 'unknown package'}): {exc!r}"
    stub = typer.Typer(add_completion=False)

    @stub.command(
        name=name, help=f"(broken plugin) {message}", short_help=f"(broken plugin: {type(exc).__name__})"
    )
    def explain() -> None:
        typer.echo(f"forge {name}: {message}", err=True)
        raise typer.Exit(1)

    return typer.main.get_command(stub)


def group_entry_points(group: str, distribution: str | None = None) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name (of one distribution only when it is named); the
    first claim of a name, by the value's order, wins."""
    found: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        if distribution is None or (ep.dist is not None and ep.dist.name == distribution):
            found.setdefault(ep.name, ep)
    return found


def entry_point_command(name: str, ep: EntryPoint) -> Any:
    """The command an entry point names: a ``typer.Typer`` app, or a function typer turns into one
    command called ``name``. Imported only now (a benchmark may import torch)."""
    try:
        obj = ep.load()
        app = obj if isinstance(obj, typer.Typer) else typer.Typer(add_completion=False)
        if app is not obj:
            if not callable(obj):
                raise TypeError(f"{ep.value} is a {type(obj).__name__}, neither a typer.Typer nor a function")
            app.command(name=name)(obj)
        command = typer.main.get_command(app)
        command.name = name
    except Exception as exc:  # noqa: BLE001 - any import-time failure becomes a stub command
        command = broken_command(name, ep, exc)
    return command


class EntryPointGroup(TyperGroup):
    """A command group whose subcommands are the entry points of :attr:`group` (of
    :attr:`distribution` only, when set), each imported only when it runs or a help lists it.

    ``forge bench`` is one (``forge.bench``: every package declares its benchmarks there, the CLI
    imports none of them); ``python -m forge_training.bench`` is another, limited to the training
    library's own."""

    group = BENCH_GROUP
    distribution: str | None = None

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted({*super().list_commands(ctx), *group_entry_points(self.group, self.distribution)})

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        builtin = super().get_command(ctx, cmd_name)
        if builtin is not None:
            return builtin
        ep = group_entry_points(self.group, self.distribution).get(cmd_name)
        return entry_point_command(cmd_name, ep) if ep is not None else None
