"""Subcommands contributed by service packages through the entry-point group ``forge.cli``.

A service registers ``name = "forge_x.cli:app"`` (a ``typer.Typer``) and gets
``forge <name> …``. The CLI never imports a service itself: a plugin is imported only when its
command runs or ``--help`` lists it, and one that fails to import becomes a stub that explains why
(exit code 1) instead of taking the whole ``forge`` command down with it.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

import typer
from typer.core import TyperGroup

from forge_kit import clitools

# typer >= 0.20 vendors its own click: commands are whatever typer.main.get_command returns,
# so plugins must be typer.Typer apps (a plain click command would not mix with them).
Command = Any

GROUP = "forge.cli"
PANEL = "Service commands"


def plugin_entry_points(group: str = GROUP) -> dict[str, list[EntryPoint]]:
    """Entry points by subcommand name. Several packages may share a name (``forge eval`` gets
    ``run``/``compare`` from eval and ``retrieval`` from the retriever): their commands merge."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        found.setdefault(ep.name, []).append(ep)
    return found


def load_plugin(name: str, eps: EntryPoint | list[EntryPoint]) -> Command:
    """Import the plugin(s) registered as ``name`` and turn them into one command."""
    if isinstance(eps, list):
        if len(eps) > 1:
            return _merged(name, [_load(name, ep) for ep in eps])
        eps = eps[0]
    command = _load(name, eps)
    command.name = name
    command.short_help = one_line(command.help)
    setattr(command, "rich_help_panel", PANEL)  # noqa: B010 - listed apart from built-ins in `forge --help`
    return command


def _load(name: str, ep: EntryPoint) -> Command:
    """The plugin's command as typer builds it (a one-command app keeps its command's name)."""
    try:
        obj = ep.load()
        if not isinstance(obj, typer.Typer):
            raise TypeError(f"{ep.value} is a {type(obj).__name__}, not a typer.Typer")
        command = typer.main.get_command(obj)
    except Exception as exc:  # noqa: BLE001 - any import-time failure becomes a stub command
        command = clitools.broken_command(name, ep, exc)
    return command


def one_line(text: str | None) -> str:
    """The first paragraph of a help text on one line (what ``forge --help`` lists)."""
    return " ".join((text or "").strip().split("\n\n")[0].split())


def _merged(name: str, commands: list[Command]) -> Command:
    """One group holding the subcommands of every plugin that claimed ``name``; a plugin that is
    a single command is added under its own name. The first claim of a subcommand name wins.

    Its help is one line: the help of the plugin with the most subcommands, then the names the
    others add (``Run benchmark tasks, … release gate. Also: retrieval.``)."""
    group = TyperGroup(name=name)
    owners: list[tuple[Command, list[str]]] = []
    for command in commands:
        subcommands = getattr(command, "commands", None) or {command.name: command}
        added = [n for n in subcommands if n not in group.commands]
        for sub_name in added:
            group.commands[sub_name] = subcommands[sub_name]
        owners.append((command, added))
    primary, _ = max(owners, key=lambda o: len(o[1]))
    others = [n for command, added in owners if command is not primary for n in added]
    lead = one_line(primary.help).rstrip(".") or f"forge {name} commands"
    group.help = group.short_help = f"{lead}. Also: {', '.join(others)}." if others else f"{lead}."
    setattr(group, "rich_help_panel", PANEL)  # noqa: B010
    return group


class PluginGroup(TyperGroup):
    """The root ``forge`` group: built-in commands plus lazily loaded plugin commands.

    An expected failure escaping any command (a service not up, a refused token, a timeout:
    :func:`forge_kit.clitools.describe_error`) ends as one line on stderr and exit status 1."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            message = clitools.describe_error(exc)
            if message is None:
                raise
            clitools.error_console.print(f"[red]forge: error[/]: {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    def list_commands(self, ctx: Any) -> list[str]:
        builtin = super().list_commands(ctx)
        plugins = sorted(n for n in plugin_entry_points() if n not in builtin)
        return [*builtin, *plugins]

    def get_command(self, ctx: Any, cmd_name: str) -> Command | None:
        builtin = super().get_command(ctx, cmd_name)
        if builtin is not None:
            return builtin
        ep = plugin_entry_points().get(cmd_name)
        return load_plugin(cmd_name, ep) if ep is not None else None
