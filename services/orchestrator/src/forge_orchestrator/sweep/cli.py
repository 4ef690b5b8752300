"""``forge sweep …``: start, follow, report on and cancel sweeps (``sweep`` workflows).

The orchestrator and its token are found as for ``forge workflows`` (``--target``,
``$FORGE_CLI_ORCHESTRATOR_TARGET``, ``$FORGE_CLI_ORCHESTRATOR_TOKEN``, ``var/secrets/tokens.json``).
A space file is checked here first, and again by the orchestrator, before any job exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from forge_experiments import sweepspace
from forge_kit import clitools, errors
from forge_kit.orchestrator_client import OrchestratorClient, response_to_dict
from forge_orchestrator.cli import JsonOption, TargetOption, TokenOption, resolve_token
from forge_orchestrator.sweep.report import trust_line, write_report

app = typer.Typer(help="Hyperparameter sweeps and ablations.", no_args_is_help=True)
console = Console()


def sweep_state(view: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep's state from GetWorkflow: its progress while it runs, its result once done."""
    if view.get("workflow_type") not in ("sweep", None):
        raise typer.BadParameter(
            f"{view.get('workflow_id')} is a {view.get('workflow_type')} workflow, not a sweep"
        )
    if "progress" in view:
        return dict(view["progress"])
    result = view.get("result") or {}
    if result:
        return {**dict(result.get("summary") or {}), "trials": result.get("trials", []), "step": "done"}
    raise typer.BadParameter(
        f"sweep {view.get('workflow_id')} is {view.get('status')} with no state to show"
        + (f": {view['error']}" if view.get("error") else "")
    )


async def _get(target: str, token: str, sweep_id: str) -> dict[str, Any]:
    async with OrchestratorClient(target, resolve_token(token)) as client:
        return response_to_dict(await client.get(sweep_id))


@app.command()
def start(
    space_file: Annotated[Path, typer.Argument(help="The space (YAML).", exists=True, dir_okay=False)],
    team: Annotated[str, typer.Option("--team", help="Team of the trials (default: the space's).")] = "",
    sweep_id: Annotated[str, typer.Option("--id", help="Sweep id (idempotent start).")] = "",
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
) -> None:
    """Check the space and start the sweep; prints its id."""
    text = space_file.read_bytes()
    if len(text) > sweepspace.MAX_FILE_BYTES:
        raise typer.BadParameter(f"larger than {sweepspace.MAX_FILE_BYTES} bytes", param_hint="SPACE_FILE")
    try:
        space = sweepspace.parse(text)
    except errors.ValidationError as exc:
        raise typer.BadParameter(str(exc), param_hint="SPACE_FILE") from None
    team = team or space.team
    if not team:
        raise typer.BadParameter("the space names no team; give --team", param_hint="--team")

    async def go() -> str:
        async with OrchestratorClient(target, resolve_token(token)) as client:
            return await client.start("sweep", {"space": text.decode(), "team": team}, sweep_id)

    console.print(clitools.run_rpc(go()))


@app.command()
def status(
    sweep_id: Annotated[str, typer.Argument(help="Sweep id.")],
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Trials by state, rung occupancy, best so far, GPU-hours used against the budget."""
    view = clitools.run_rpc(_get(target, token, sweep_id))
    state = sweep_state(view)
    record = {
        "sweep": sweep_id,
        "status": view.get("status"),
        "step": state.get("step", ""),
        "trials_by_state": state.get("trials_by_state", {}),
        "rung_occupancy": state.get("rung_occupancy", {}),
        "best_trial": state.get("best_trial"),
        "best_metric": state.get("best_metric"),
        "best_params": state.get("best_params"),
        "gpu_hours": f"{state.get('gpu_hours', 0)} of {state.get('gpu_hours_budget', 0)}",
        "ignored_metrics": state.get("ignored_metrics", 0),
        "ignored_recent": state.get("ignored_recent", []),
    }
    if state.get("trust"):
        record["rung_trust"] = trust_line(state["trust"])
    if state.get("parent_run_id"):
        record["tracking_run"] = state["parent_run_id"]
    clitools.show_record(record, as_json)
    if not as_json:
        rows = [
            {
                "trial": int(t.get("index", 0)),
                "state": t.get("state"),
                "params": ", ".join(f"{k}={v}" for k, v in (t.get("params") or {}).items()),
                "seed": t.get("seed"),
                "last step": int(t["values"][-1][0]) if t.get("values") else "",
                "final": t.get("final"),
                "reason": (t.get("reason") or "")[:60],
            }
            for t in state.get("trials", [])
        ]
        clitools.show_rows(
            rows, ["trial", "state", "params", "seed", "last step", "final", "reason"], False, "trials"
        )


@app.command()
def report(
    sweep_id: Annotated[str, typer.Argument(help="Sweep id.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for report.md, curves.png, effects.png.")],
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
) -> None:
    """Write the sweep's report (Markdown + PNG): per-configuration means with intervals, paired
    differences against the baseline, factor effects, the metric against budget per trial."""
    state = sweep_state(clitools.run_rpc(_get(target, token, sweep_id)))
    path = write_report(state, out)
    console.print(f"wrote {path}")


@app.command()
def cancel(
    sweep_id: Annotated[str, typer.Argument(help="Sweep id.")],
    reason: Annotated[str, typer.Option("--reason", help="Recorded with the cancellation.")] = "",
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
) -> None:
    """Cancel the sweep (its running trials are cancelled; finished ones stay recorded)."""

    async def go() -> None:
        async with OrchestratorClient(target, resolve_token(token)) as client:
            await client.cancel(sweep_id, reason)

    clitools.run_rpc(go())
    console.print(f"cancellation of {sweep_id} requested")
