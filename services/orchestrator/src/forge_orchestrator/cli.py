"""``forge workflows …``: start, inspect and cancel orchestrator workflows.

The orchestrator is found at ``$FORGE_CLI_ORCHESTRATOR_TARGET`` (default ``127.0.0.1:50059``);
its token is in the file ``--token-file`` names, else ``$FORGE_CLI_ORCHESTRATOR_TOKEN``, else the ``orchestrator`` entry of
``var/secrets/tokens.json`` (written by ``forge up``) under ``$FORGE_ROOT`` or the nearest
directory above the current one that has it, else the services' development default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from forge_kit import clitools
from forge_kit.orchestrator_client import OrchestratorClient, response_to_dict

app = typer.Typer(help="Start, inspect and cancel orchestrator workflows.", no_args_is_help=True)
console = Console()

TargetOption = Annotated[
    str, typer.Option("--target", envvar="FORGE_CLI_ORCHESTRATOR_TARGET", help="Orchestrator gRPC host:port.")
]
TokenOption = Annotated[str, clitools.token_option("FORGE_CLI_ORCHESTRATOR_TOKEN", "orchestrator token")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def resolve_token(explicit: str, start: Path | None = None) -> str:
    """The explicit token, else the token file's ``orchestrator`` entry, else the dev default."""
    return clitools.resolve_token("orchestrator", explicit, start)


@app.command()
def start(
    workflow_type: Annotated[str, typer.Argument(help="Workflow type, e.g. smoke.")],
    input_json: Annotated[str, typer.Option("--input", help="Workflow input as a JSON object.")] = "{}",
    workflow_id: Annotated[
        str, typer.Option("--id", help="Workflow id (idempotent start); generated when empty.")
    ] = "",
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the workflow closes and show it.")] = False,
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.0,
            help="Seconds to wait with --wait; past it, exit 3 saying how to keep waiting.",
        ),
    ] = 300.0,
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Start a workflow and print its id (or, with --wait, how it ended)."""
    try:
        data = json.loads(input_json)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--input") from None
    if not isinstance(data, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="--input")

    async def go() -> dict[str, Any]:
        async with OrchestratorClient(target, resolve_token(token)) as client:
            started = await client.start(workflow_type, data, workflow_id)
            if not wait:
                return {"workflow_id": started}
            return await _wait(client, started, timeout_s)

    _show_closed(clitools.run_rpc(go()), wait, as_json)


@app.command("wait")
def wait_for(
    workflow_id: Annotated[str, typer.Argument(help="Workflow id.")],
    timeout_s: Annotated[float, typer.Option("--timeout", min=0.0, help="Seconds to wait.")] = 3600.0,
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Wait until a running workflow closes and show how it ended (exit 1 unless COMPLETED,
    3 when still running at --timeout)."""

    async def go() -> dict[str, Any]:
        async with OrchestratorClient(target, resolve_token(token)) as client:
            return await _wait(client, workflow_id, timeout_s)

    _show_closed(clitools.run_rpc(go()), True, as_json)


STILL_RUNNING_EXIT = 3
"""Exit status of ``start --wait`` / ``wait`` when the workflow outlived ``--timeout``."""


async def _wait(client: OrchestratorClient, workflow_id: str, timeout_s: float) -> dict[str, Any]:
    try:
        return response_to_dict(await client.wait(workflow_id, timeout_s=timeout_s))
    except TimeoutError:
        return {"workflow_id": workflow_id, "still_running_after_s": timeout_s}


def _show_closed(result: dict[str, Any], waited: bool, as_json: bool) -> None:
    if "still_running_after_s" in result:
        wid = result["workflow_id"]
        typer.secho(
            f"workflow {wid} is still running after {result['still_running_after_s']:g} s; "
            f"keep waiting with `forge workflows wait {wid} --timeout SECONDS`, "
            f"or look at it with `forge workflows get {wid}`",
            err=True,
            fg=typer.colors.YELLOW,
        )
        raise typer.Exit(STILL_RUNNING_EXIT)
    clitools.show_record(result, as_json)
    if waited and result.get("status") != "COMPLETED":
        raise typer.Exit(1)


@app.command()
def get(
    workflow_id: Annotated[str, typer.Argument(help="Workflow id.")],
    run_id: Annotated[str, typer.Option("--run-id", help="Run id; the latest run when empty.")] = "",
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
    mlflow_uri: Annotated[
        str, typer.Option("--mlflow-uri", envvar="FORGE_CLI_MLFLOW_URI", help="MLflow tracking server URL.")
    ] = "http://127.0.0.1:8060",
    as_json: JsonOption = False,
) -> None:
    """Show a workflow's status, result, error or progress, and the MLflow pages of its runs."""

    async def go() -> dict[str, Any]:
        async with OrchestratorClient(target, resolve_token(token)) as client:
            return response_to_dict(await client.get(workflow_id, run_id))

    record = clitools.run_rpc(go())
    links = mlflow_links(mlflow_uri, workflow_id)
    if links:
        record["mlflow"] = links[0] if len(links) == 1 else links
    clitools.show_record(record, as_json)


app.command("show", help="Same as `get`.")(get)


def mlflow_links(uri: str, workflow_id: str) -> list[str]:
    """The MLflow pages of the runs a workflow's jobs made; none when MLflow is not reachable."""
    from forge_orchestrator.tracking.cli import tracker_for
    from forge_orchestrator.tracking.tracker import RunFilter

    try:
        runs = tracker_for(uri).find_runs(RunFilter(workflow_id=workflow_id), max_results=20)
    except Exception as exc:  # noqa: BLE001 - the workflow is shown either way
        console.print(f"[yellow]MLflow at {uri} not consulted[/]: {str(exc)[:200]}", highlight=False)
        return []
    return [run.url for run in runs]


@app.command()
def cancel(
    workflow_id: Annotated[str, typer.Argument(help="Workflow id.")],
    reason: Annotated[str, typer.Option("--reason", help="Why; recorded with the cancellation.")] = "",
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
) -> None:
    """Request cancellation of a running workflow (it cancels the jobs it started)."""

    async def go() -> None:
        async with OrchestratorClient(target, resolve_token(token)) as client:
            await client.cancel(workflow_id, reason)

    clitools.run_rpc(go())
    console.print(f"cancellation of {workflow_id} requested")
