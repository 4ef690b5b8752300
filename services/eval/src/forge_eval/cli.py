"""``forge eval …``: run YAML tasks against an OpenAI-compatible endpoint, compare two runs with
the release gate, re-score stored predictions, list the shipped tasks.

These work on run folders and need no eval server: ``forge eval run`` writes ``DIR/summary.json``
(spec hash, per-task score, stderr and interval), samples and ``report.md``; ``forge eval
compare RUN_A RUN_B`` prints the paired deltas of B against A and the gate decision. Responses are
cached (request + model identity) in ``--cache`` so an unchanged re-run makes no model calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from forge_eval.backend import BackendError, OpenAIBackend, ResponseCache
from forge_eval.harness import (
    TaskRun,
    compare_runs,
    comparison_report,
    plot_deltas,
    read_run,
    read_samples,
    rescore_task,
    run_task,
    write_run,
)
from forge_eval.spec import resolve_data_path
from forge_eval.tasks import DataRoots, load_task, shipped_tasks
from forge_kit import errors

app = typer.Typer(help="Run benchmark tasks, compare runs and apply the release gate.", no_args_is_help=True)

DEFAULT_CACHE = Path("var") / "cache" / "eval" / "responses.sqlite"


def _fail(message: str) -> typer.Exit:
    typer.secho(message, fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _roots(benchmarks: str, corpora: str) -> DataRoots:
    return DataRoots(resolve_data_path(benchmarks), resolve_data_path(corpora))


@app.command()
def run(
    task: Annotated[
        list[str], typer.Option("--task", help="Task YAML file or shipped task name (repeatable).")
    ],
    endpoint: Annotated[
        str, typer.Option("--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000.")
    ],
    model: Annotated[str, typer.Option("--model", help="Model name as the endpoint serves it.")],
    out: Annotated[Path, typer.Option("--out", help="Run folder to write.")],
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", help="Checkpoint folder to hash for the model identity.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Seeded subset of this many examples (0: all).")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for subsets, sampling and bootstrap.")] = 0,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="The smoke tier: each task's stratified subset.")
    ] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Prompts per request.")] = 16,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Requests in flight.")] = 8,
    cache: Annotated[Path, typer.Option("--cache", help="Response cache (SQLite).")] = DEFAULT_CACHE,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the cache.")] = False,
    token: Annotated[
        str, typer.Option("--token", envvar="FORGE_CLI_EVAL_ENDPOINT_TOKEN", show_default=False)
    ] = "",
    benchmarks_dir: Annotated[str, typer.Option("--benchmarks-dir")] = "../shared/data/benchmarks",
    corpora_dir: Annotated[str, typer.Option("--corpora-dir")] = "../shared/data/corpora",
) -> None:
    """Evaluate tasks on a model and write DIR/summary.json, samples and report.md."""
    try:
        configs = [load_task(t) for t in task]
    except errors.ForgeError as exc:
        raise _fail(f"invalid task: {exc}") from None
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise _fail("--task: the same task is given twice")
    roots = _roots(benchmarks_dir, corpora_dir)

    async def go() -> dict[str, Any]:
        store = None if no_cache else ResponseCache(cache)
        backend = OpenAIBackend(
            endpoint, model, cache=store, token=token, batch_size=batch_size, concurrency=concurrency
        )
        try:
            identity = await backend.identity(checkpoint)
            started = time.perf_counter()
            runs: list[TaskRun] = []
            for config in configs:
                runs.append(
                    await run_task(config, roots, backend, identity, limit=limit, seed=seed, smoke=smoke)
                )
            elapsed = time.perf_counter() - started
        finally:
            await backend.aclose()
            if store:
                store.close()
        calls = {
            "model_calls": backend.stats.model_calls,
            "prompts_sent": backend.stats.prompts_sent,
            "cache_hits": backend.stats.cache_hits,
            "retries": backend.stats.retries,
        }
        return write_run(
            out,
            runs,
            {
                "model": {**identity.__dict__},
                "endpoint": endpoint,
                "calls": calls,
                "elapsed_s": round(elapsed, 3),
            },
        )

    try:
        summary = asyncio.run(go())
    except (errors.ForgeError, BackendError) as exc:
        raise _fail(str(exc)) from None
    typer.echo((out / "report.md").read_text())
    typer.echo(f"spec hash {summary['spec_hash']}; wrote {out / 'summary.json'}")


@app.command()
def compare(
    run_a: Annotated[Path, typer.Argument(help="Baseline run folder.")],
    run_b: Annotated[Path, typer.Argument(help="Candidate run folder.")],
    tolerance: Annotated[
        list[str] | None, typer.Option("--tolerance", help="TASK=DROP overriding a task's gate tolerance.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    fail_on_regression: Annotated[
        bool, typer.Option("--fail-on-regression", help="Exit 1 when the gate blocks.")
    ] = False,
    report: Annotated[
        Path | None,
        typer.Option("--report", help="Folder for comparison.md, comparison.json and deltas.png."),
    ] = None,
) -> None:
    """Paired deltas of RUN_B against RUN_A per task and metric, and the gate decision."""
    overrides: dict[str, float] = {}
    for item in tolerance or []:
        name, _, value = item.partition("=")
        try:
            overrides[name] = float(value)
        except ValueError:
            raise _fail(f"--tolerance: {item!r} is not TASK=NUMBER") from None
    try:
        decision = compare_runs(run_a, run_b, tolerances=overrides)
    except errors.ForgeError as exc:
        raise _fail(str(exc)) from None
    payload = {
        "passed": decision.passed,
        "decision": "PASS" if decision.passed else "BLOCK",
        "comparisons": decision.comparisons,
        "confidence": decision.confidence,
        "rows": [
            {
                "task": r.task,
                "metric": r.metric,
                "tolerance": r.tolerance,
                "regression": r.regression,
                "higher_is_better": r.higher_is_better,
                **r.result.__dict__,
            }
            for r in decision.rows
        ],
    }
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        header = f"# Comparison\n\n- baseline: `{run_a}`\n- candidate: `{run_b}`\n\n"
        (report / "comparison.md").write_text(
            header + comparison_report(decision) + "\n![deltas](deltas.png)\n"
        )
        (report / "comparison.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        plot_deltas(decision, report / "deltas.png")
    if as_json:
        typer.echo(json.dumps(payload, indent=2, sort_keys=True))
    else:
        typer.echo(comparison_report(decision))
    if fail_on_regression and not decision.passed:
        raise typer.Exit(1)


@app.command()
def rescore(
    run_dir: Annotated[Path, typer.Argument(help="Run folder with stored samples.")],
    task: Annotated[str, typer.Option("--task", help="The task YAML with the new scorer.")],
    out: Annotated[Path, typer.Option("--out", help="Run folder to write.")],
) -> None:
    """Re-score stored predictions with a (new) scorer version: no model calls."""
    try:
        config = load_task(task)
        old = read_run(run_dir)
        if config.name not in old["tasks"]:
            raise errors.ValidationError("task", f"{run_dir} has no task {config.name!r}")
        result = rescore_task(config, old["specs"][config.name], read_samples(run_dir, config.name))
    except errors.ForgeError as exc:
        raise _fail(str(exc)) from None
    extra: dict[str, Any] = {k: old[k] for k in ("model", "endpoint") if k in old}
    summary = write_run(
        out, [result], {**extra, "calls": {"model_calls": 0, "cache_hits": 0}, "rescored_from": str(run_dir)}
    )
    typer.echo(f"spec hash {summary['spec_hash']}; wrote {out / 'summary.json'}")


@app.command("tasks")
def list_tasks() -> None:
    """The shipped task files."""
    for name, path in sorted(shipped_tasks().items()):
        typer.echo(f"{name}\t{path}")
