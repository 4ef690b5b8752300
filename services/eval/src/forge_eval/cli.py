"""``forge eval …``: run YAML tasks against an OpenAI-compatible endpoint, compare two runs with
the release gate, re-score stored predictions, list the shipped tasks — and the model registry.

``run``, ``compare``, ``rescore`` and ``tasks`` work on run folders and need no eval server:
``forge eval run`` writes ``DIR/summary.json`` (spec hash, per-task score, stderr and interval),
samples and ``report.md``; ``forge eval compare RUN_A RUN_B`` prints the paired deltas of B against
A and the gate decision. Responses are cached (request + model identity) in ``--cache`` so an
unchanged re-run makes no model calls.

``register``, ``models``, ``promote``, ``rollback`` and ``history`` call the eval service's
registry over gRPC at ``$FORGE_CLI_EVAL_TARGET`` (default ``127.0.0.1:50057``) with the token in
``--token-file``, else ``$FORGE_CLI_EVAL_TOKEN``, else the ``eval`` entry of ``var/secrets/tokens.json`` (the service
token: an admin, who may ``promote --force``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from google.protobuf import json_format

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
from forge_eval.tasks import DataRoots, load_task, shipped_tasks
from forge_kit import clitools, errors
from forge_kit.grpckit import make_channel
from forge_kit.modelref import ModelRef, label
from forge_kit.paths import resolve_data_path

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
    concurrency: Annotated[
        int,
        typer.Option(
            "--concurrency",
            min=1,
            help="Most requests in flight; the client adapts below it to the server's 429/503 answers.",
        ),
    ] = 64,
    cache: Annotated[Path, typer.Option("--cache", help="Response cache (SQLite).")] = DEFAULT_CACHE,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the cache.")] = False,
    token: Annotated[
        str, clitools.token_option("FORGE_CLI_EVAL_ENDPOINT_TOKEN", "model endpoint's bearer token")
    ] = "",
    benchmarks_dir: Annotated[
        str, typer.Option("--benchmarks-dir", help="Absolute, or a folder inside FORGE_DATA_DIR.")
    ] = "benchmarks",
    corpora_dir: Annotated[
        str, typer.Option("--corpora-dir", help="Absolute, or a folder inside FORGE_DATA_DIR.")
    ] = "corpora",
    quiet: Annotated[bool, clitools.QuietOption] = False,
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
            with clitools.progress(quiet) as bar:
                for config in configs:
                    step = bar.add_task(f"{config.name}: requests answered", total=None)
                    backend.on_answers = functools.partial(bar.advance, step)
                    runs.append(
                        await run_task(config, roots, backend, identity, limit=limit, seed=seed, smoke=smoke)
                    )
                    bar.update(step, total=bar.tasks[step].completed)
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
            "overloads": backend.stats.overloads,
            "lowest_concurrency": backend.stats.lowest_concurrency,
            "batches_split": backend.stats.batches_split,
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


# --- the registry, over gRPC ----------------------------------------------------------------------

TargetOption = Annotated[
    str, typer.Option("--target", envvar="FORGE_CLI_EVAL_TARGET", help="Eval service gRPC host:port.")
]
TokenOption = Annotated[str, clitools.token_option("FORGE_CLI_EVAL_TOKEN", "eval service token")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _ref(text: str) -> common_pb2.ModelRef:
    try:
        ref = ModelRef.parse(text)
    except ValueError as exc:
        raise typer.BadParameter(f"must be NAME or NAME:VERSION ({exc})", param_hint="MODEL") from None
    return common_pb2.ModelRef(name=ref.name, version=ref.version)


def _call(target: str, token: str, call: Any) -> Any:
    """Run ``call(stub)`` against the eval service; a gRPC error is one red line and exit 1."""

    async def go() -> Any:
        async with make_channel(target, token=clitools.resolve_token("eval", token)) as channel:
            return await call(eval_pb2_grpc.EvalServiceStub(channel))

    return clitools.run_rpc(go())


def _dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


@app.command()
def register(
    model: Annotated[
        str, typer.Argument(help="NAME or NAME:VERSION (an empty version takes the next number).")
    ],
    uri: Annotated[str, typer.Option("--uri", help="Where the checkpoint is (a local HF folder or a URL).")],
    training_run: Annotated[str, typer.Option("--training-run", help="Training run that produced it.")] = "",
    recipe_hash: Annotated[str, typer.Option("--recipe-hash")] = "",
    data_hash: Annotated[str, typer.Option("--data-hash")] = "",
    parent: Annotated[
        str, typer.Option("--parent", help="Registered NAME:VERSION it was trained from.")
    ] = "",
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Register a checkpoint as a candidate, with its lineage."""
    lineage = eval_pb2.Lineage(training_run_id=training_run, recipe_hash=recipe_hash, data_hash=data_hash)
    if parent:
        lineage.parent.CopyFrom(_ref(parent))
    request = eval_pb2.RegisterModelRequest(ref=_ref(model), uri=uri, lineage=lineage)
    reply = _call(target, token, lambda stub: stub.RegisterModel(request, timeout=10))
    clitools.show_record(_dict(reply.model), as_json)


@app.command()
def models(
    name: Annotated[str, typer.Option("--name", help="Only this model family.")] = "",
    stage: Annotated[str, typer.Option("--stage", help="candidate, canary, production or archived.")] = "",
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Registered models, newest first."""
    request = eval_pb2.ListModelsRequest(name=name, stage=stage, page=common_pb2.PageRequest(page_size=100))
    reply = _call(target, token, lambda stub: stub.ListModels(request, timeout=10))
    rows = [
        {
            "model": label(m.ref.name, m.ref.version),
            "stage": m.stage,
            "traffic": m.traffic_percent or "",
            "training_run": m.lineage.training_run_id,
            "parent": label(m.lineage.parent.name, m.lineage.parent.version) if m.lineage.parent.name else "",
            "uri": m.uri,
            "runs": len(m.eval_run_ids),
        }
        for m in reply.models
    ]
    clitools.show_rows(rows, ["model", "stage", "traffic", "training_run", "parent", "uri", "runs"], as_json)


@app.command()
def promote(
    model: Annotated[str, typer.Argument(help="NAME:VERSION.")],
    stage: Annotated[str, typer.Option("--stage", help="canary, production or archived.")],
    traffic: Annotated[
        int, typer.Option("--traffic", min=0, max=100, help="Share of the stage (0: 100).")
    ] = 0,
    reason: Annotated[str, typer.Option("--reason", help="Why (required with --force).")] = "",
    force: Annotated[
        bool, typer.Option("--force", help="Past a failing release gate: admins only, audited.")
    ] = False,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Move a model along its lifecycle through the release gate."""
    request = eval_pb2.PromoteModelRequest(
        ref=_ref(model), stage=stage, traffic_percent=traffic, reason=reason, force=force
    )
    reply = _call(target, token, lambda stub: stub.PromoteModel(request, timeout=10))
    clitools.show_record(_dict(reply.event), as_json)


@app.command()
def rollback(
    stage: Annotated[str, typer.Option("--stage", help="canary or production.")],
    reason: Annotated[str, typer.Option("--reason", help="Why.")] = "",
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Give a stage back to the model it replaced; the current holder is archived."""
    request = eval_pb2.RollbackModelRequest(stage=stage, reason=reason)
    reply = _call(target, token, lambda stub: stub.RollbackModel(request, timeout=10))
    clitools.show_record(_dict(reply.event), as_json)


@app.command()
def history(
    model: Annotated[str, typer.Argument(help="NAME or NAME:VERSION; empty for all.")] = "",
    stage: Annotated[str, typer.Option("--stage", help="Only changes into this stage.")] = "",
    forced: Annotated[bool, typer.Option("--forced", help="Only promotions forced past the gate.")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, max=500)] = 50,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """The registry's audit trail, newest first: who changed which stage, when and why."""
    ref = _ref(model) if model else common_pb2.ModelRef()
    request = eval_pb2.ListStageEventsRequest(
        model_name=ref.name,
        model_version=ref.version,
        stage=stage,
        forced_only=forced,
        page=common_pb2.PageRequest(page_size=limit),
    )
    reply = _call(target, token, lambda stub: stub.ListStageEvents(request, timeout=10))
    if as_json:
        typer.echo(json.dumps([_dict(e) for e in reply.events], indent=2, sort_keys=True))
        return
    rows = [
        {
            "when": e.created_at.ToDatetime().isoformat(timespec="seconds"),
            "action": e.action,
            "model": label(e.model.name, e.model.version),
            "stage": f"{e.from_stage or '-'} -> {e.to_stage}",
            "actor": e.actor,
            "forced": "FORCED" if e.forced else "",
            "reason": e.reason,
            "evidence": evidence_summary(e.evidence),
        }
        for e in reply.events
    ]
    clitools.show_rows(
        rows, ["when", "action", "model", "stage", "actor", "forced", "reason", "evidence"], False
    )


def evidence_summary(evidence: str) -> str:
    """A canary decision's evidence in a line: the policy, each metric's canary and production
    counts with the always-valid p-values (harm / non-inferiority)."""
    if not evidence:
        return ""
    try:
        data = json.loads(evidence)
    except ValueError:
        return "(unreadable)"
    parts = [f"{data.get('policy', '?')} at {data.get('elapsed_s', '?')}s"]
    for name, m in (data.get("metrics") or {}).items():
        parts.append(
            f"{name} {m['canary_k']}/{m['canary_n']} vs {m['production_k']}/{m['production_n']}"
            f" p={m['harm_p']:.2g}/{m['noninf_p']:.2g}"
        )
    return "; ".join(parts)


rollout_app = typer.Typer(
    help="A guarded canary: its state, and an operator's override (audited: who, when, why).",
    no_args_is_help=True,
)
app.add_typer(rollout_app, name="rollout")
ReasonOption = Annotated[str, typer.Option("--reason", help="Why (required: it is audited).")]


def _canary_of(target: str, token: str, model: str) -> eval_pb2.RegisteredModel | None:
    """The registered model in canary named by ``model`` (NAME: the family's canary)."""
    ref = _ref(model)
    request = eval_pb2.ListModelsRequest(
        name=ref.name, stage="canary", page=common_pb2.PageRequest(page_size=10)
    )
    reply = _call(target, token, lambda stub: stub.ListModels(request, timeout=10))
    found = [m for m in reply.models if not ref.version or m.ref.version == ref.version]
    return found[0] if found else None


@rollout_app.command("status")
def rollout_status(
    model: Annotated[str, typer.Argument(help="NAME or NAME:VERSION.")],
    limit: Annotated[int, typer.Option("--limit", min=1, max=100)] = 10,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """The model's canary (traffic share, paused or not) and its latest rollout decisions."""
    ref = _ref(model)
    canary = _canary_of(target, token, model)
    request = eval_pb2.ListStageEventsRequest(
        model_name=ref.name,
        model_version=canary.ref.version if canary is not None else ref.version,
        page=common_pb2.PageRequest(page_size=limit),
    )
    events = _call(target, token, lambda stub: stub.ListStageEvents(request, timeout=10)).events
    toggles = [e.action for e in events if e.action in ("pause", "resume")]
    status: dict[str, Any] = {
        "canary": label(canary.ref.name, canary.ref.version) if canary is not None else "",
        "traffic_percent": canary.traffic_percent if canary is not None else 0,
        "paused": bool(toggles) and toggles[0] == "pause",
        "decisions": [
            {
                "when": e.created_at.ToDatetime().isoformat(timespec="seconds"),
                "action": e.action,
                "model": label(e.model.name, e.model.version),
                "actor": e.actor,
                "reason": e.reason,
                "evidence": json.loads(e.evidence)
                if as_json and e.evidence
                else evidence_summary(e.evidence),
            }
            for e in events
        ],
    }
    if as_json:
        typer.echo(json.dumps(status, indent=2, sort_keys=True))
        return
    typer.echo(
        f"canary: {status['canary'] or '(none)'}  traffic: {status['traffic_percent']}%"
        + ("  PAUSED" if status["paused"] else "")
    )
    clitools.show_rows(status["decisions"], ["when", "action", "model", "actor", "reason", "evidence"], False)


def _decide(model: str, decision: str, reason: str, target: str, token: str, as_json: bool) -> None:
    canary = _canary_of(target, token, model)
    ref = canary.ref if canary is not None else _ref(model)
    if not ref.version:
        raise _fail(f"{model} has no model in canary")
    request = eval_pb2.DecideRolloutRequest(ref=ref, decision=decision, reason=reason)
    reply = _call(target, token, lambda stub: stub.DecideRollout(request, timeout=10))
    clitools.show_record(_dict(reply.event), as_json)


@rollout_app.command("promote")
def rollout_promote(
    model: Annotated[str, typer.Argument(help="NAME (its canary) or NAME:VERSION.")],
    reason: ReasonOption,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Promote the canary to production now (the analysis stops)."""
    _decide(model, "promote", reason, target, token, as_json)


@rollout_app.command("rollback")
def rollout_rollback(
    model: Annotated[str, typer.Argument(help="NAME (its canary) or NAME:VERSION.")],
    reason: ReasonOption,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Roll the canary back now: its traffic to 0, the model archived (the analysis stops)."""
    _decide(model, "rollback", reason, target, token, as_json)


@rollout_app.command("pause")
def rollout_pause(
    model: Annotated[str, typer.Argument(help="NAME (its canary) or NAME:VERSION.")],
    reason: ReasonOption,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Hold the canary at its share: the analysis keeps watching but only rolls back, never promotes."""
    _decide(model, "pause", reason, target, token, as_json)


@rollout_app.command("resume")
def rollout_resume(
    model: Annotated[str, typer.Argument(help="NAME (its canary) or NAME:VERSION.")],
    reason: ReasonOption,
    target: TargetOption = "127.0.0.1:50057",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Let a paused analysis decide again."""
    _decide(model, "resume", reason, target, token, as_json)
