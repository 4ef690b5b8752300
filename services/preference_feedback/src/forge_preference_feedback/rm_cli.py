"""``forge rm …``: reward models — score a checkpoint on preference pairs, and the registry.

``forge rm eval (--checkpoint DIR | --version latest) --pairs FILE.jsonl.gz --out OUT`` is the
benchmark contract: it scores HH-RLHF-format pairs with a Hugging Face reward-model checkpoint
and writes ``OUT/summary.json`` = ``{"accuracy", "ci95_low", "ci95_high", "n"}`` (Wilson
interval; see :mod:`forge_training.rm.eval`). ``--version`` (a version, ``latest`` or ``active``, with
``--name``) is resolved through the registry over gRPC at ``$FORGE_CLI_PREFERENCE_FEEDBACK_TARGET``
(default ``127.0.0.1:50058``). ``forge rm list`` / ``register`` / ``set-status`` are the registry
itself (register and set-status need the service token, i.e. an admin).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from google.protobuf import json_format

from forge_experiments import rmlength
from forge_kit import clitools
from forge_kit.grpckit import make_channel
from forge_kit.modelref import ModelRef, label

app = typer.Typer(
    help="Reward models: score checkpoints on preference pairs; the registry.", no_args_is_help=True
)
SERVICE = "preference_feedback"
STATUSES = {
    "candidate": feedback_pb2.REWARD_MODEL_STATUS_CANDIDATE,
    "active": feedback_pb2.REWARD_MODEL_STATUS_ACTIVE,
    "retired": feedback_pb2.REWARD_MODEL_STATUS_RETIRED,
}
TargetOption = Annotated[
    str,
    typer.Option(
        "--target", envvar="FORGE_CLI_PREFERENCE_FEEDBACK_TARGET", help="Preference feedback gRPC host:port."
    ),
]
TokenOption = Annotated[
    str, clitools.token_option("FORGE_CLI_PREFERENCE_FEEDBACK_TOKEN", "preference feedback service token")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _call(target: str, token: str, call: Any) -> Any:
    """Run ``call(stub)`` against the feedback service; a gRPC error is one red line and exit 1."""

    async def go() -> Any:
        async with make_channel(target, token=clitools.resolve_token(SERVICE, token)) as channel:
            return await call(feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel))

    return clitools.run_rpc(go())


def _dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _local_copy(uri: str, into: Path) -> Path:
    """A local folder with the checkpoint at ``uri`` (a path, ``file://`` or any fsspec URL)."""
    if "://" not in uri or uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    fs.get(path.rstrip("/") + "/", str(into) + "/", recursive=True)
    return into


@app.command("eval")
def eval_(
    pairs: Annotated[
        Path, typer.Option("--pairs", help="HH-RLHF pairs (chosen, rejected) as .jsonl or .jsonl.gz.")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Folder for summary.json, details.json, scores.jsonl.gz.")
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="Hugging Face reward-model folder.", show_default=False),
    ] = None,
    version: Annotated[
        str,
        typer.Option(
            "--version", help="A registered version, 'latest' or 'active' (instead of --checkpoint)."
        ),
    ] = "",
    name: Annotated[str, typer.Option("--name", help="Reward-model name for --version (default: any).")] = "",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Pairs per forward pass.")] = 16,
    max_length: Annotated[
        int, typer.Option("--max-length", min=0, help="Tokens per sequence (0: the model's maximum).")
    ] = 0,
    target: TargetOption = "127.0.0.1:50058",
    token: TokenOption = "",
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Held-out pairwise accuracy of a reward model on a file of pairs, with its 95% Wilson interval."""
    # The training library (the ``rm`` extra) scores; the other commands only talk to the registry.
    from forge_training.rm.eval import PairsError
    from forge_training.rm.score import score_pairs

    if (checkpoint is None) == (not version):
        raise typer.BadParameter(
            "give exactly one of --checkpoint DIR and --version VERSION", param_hint="--checkpoint"
        )
    details: dict[str, Any] = {"pairs_file": str(pairs), "reward_model": None}
    with tempfile.TemporaryDirectory(prefix="forge-rm-") as scratch:
        if checkpoint is None:
            request = feedback_pb2.GetRewardModelRequest(ref=common_pb2.ModelRef(name=name, version=version))
            found = _call(target, token, lambda stub: stub.GetRewardModel(request, timeout=10)).reward_model
            details["reward_model"] = label(found.ref.name, found.ref.version)
            details["registered_snapshot_id"] = found.snapshot_id
            checkpoint = _local_copy(found.uri, Path(scratch))
        try:
            with clitools.progress(quiet) as bar:
                step = bar.add_task("pairs scored", total=None)
                summary = score_pairs(
                    checkpoint,
                    pairs,
                    out,
                    batch_size=batch_size,
                    max_length=max_length,
                    details=details,
                    on_scored=lambda count: bar.advance(step, count),
                )
        except (PairsError, OSError) as exc:
            typer.echo(f"forge rm eval: {exc}", err=True)
            raise typer.Exit(2) from None
    typer.echo(json.dumps(summary, sort_keys=True))


@app.command("list")
def list_(
    name: Annotated[str, typer.Option("--name", help="Only this name.")] = "",
    target: TargetOption = "127.0.0.1:50058",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Registered reward-model versions, newest first."""
    request = feedback_pb2.ListRewardModelsRequest(name=name, page=common_pb2.PageRequest(page_size=100))
    reply = _call(target, token, lambda stub: stub.ListRewardModels(request, timeout=10))
    if as_json:
        clitools.show_rows([_dict(m) for m in reply.reward_models], [], True)
        return
    rows = []
    for m in reply.reward_models:
        h = m.heldout
        status = feedback_pb2.RewardModelStatus.Name(m.status).removeprefix("REWARD_MODEL_STATUS_").lower()
        rows.append(
            {
                "model": label(m.ref.name, m.ref.version),
                "status": status,
                "accuracy": f"{h.accuracy:.3f} [{h.ci95_low:.3f}, {h.ci95_high:.3f}] n={h.n}" if h.n else "-",
                "shorter-preferred": _stratum(m.metrics, "preferred_shorter"),
                "snapshot": m.snapshot_id,
                "backbone": m.backbone,
                "uri": m.uri,
            }
        )
    clitools.show_rows(
        rows, ["model", "status", "accuracy", "shorter-preferred", "snapshot", "backbone", "uri"], False
    )


def _stratum(metrics: Any, name: str) -> str:
    """``acc [low, high] n=N`` of a length group from a version's metrics, ``-`` when absent."""
    key = f"heldout_{name}_"
    if f"{key}accuracy" not in metrics:
        return "-"
    return (
        f"{metrics[key + 'accuracy']:.3f} [{metrics[key + 'ci95_low']:.3f}, "
        f"{metrics[key + 'ci95_high']:.3f}] n={int(metrics[key + 'n'])}"
    )


@app.command()
def register(
    name: Annotated[str, typer.Argument(help="Reward-model name.")],
    uri: Annotated[str, typer.Option("--uri", help="Checkpoint location (Hugging Face folder).")],
    snapshot_id: Annotated[str, typer.Option("--snapshot", help="Training snapshot id it was trained on.")],
    backbone: Annotated[str, typer.Option("--backbone", help="Model it was initialised from.")],
    summary: Annotated[
        Path, typer.Option("--summary", help="summary.json of `forge rm eval` on its held-out pairs.")
    ],
    version: Annotated[str, typer.Option("--version", help="Version (default: the next integer).")] = "",
    target: TargetOption = "127.0.0.1:50058",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Register an immutable version with its held-out accuracy (from `forge rm eval`); the
    accuracy by which reply is longer goes into its metrics (``heldout_preferred_shorter_accuracy``, …)."""
    try:
        figures = json.loads(summary.read_text())
        heldout = feedback_pb2.PairwiseAccuracy(
            accuracy=float(figures["accuracy"]),
            ci95_low=float(figures["ci95_low"]),
            ci95_high=float(figures["ci95_high"]),
            n=int(figures["n"]),
            interval="wilson",
        )
        by_length = rmlength.registry_metrics(figures)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise typer.BadParameter(
            f"not a `forge rm eval` summary.json: {exc!r}", param_hint="--summary"
        ) from None
    request = feedback_pb2.RegisterRewardModelRequest(
        ref=common_pb2.ModelRef(name=name, version=version),
        uri=uri,
        snapshot_id=snapshot_id,
        backbone=backbone,
        heldout=heldout,
        metrics=by_length,
    )
    reply = _call(target, token, lambda stub: stub.RegisterRewardModel(request, timeout=10))
    clitools.show_record(_dict(reply.reward_model), as_json)


@app.command("set-status")
def set_status(
    model: Annotated[str, typer.Argument(help="NAME:VERSION")],
    status: Annotated[str, typer.Argument(help="candidate, active or retired")],
    target: TargetOption = "127.0.0.1:50058",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Move a version between candidate, active and retired (activating retires the active one)."""
    try:
        ref = ModelRef.parse(model)
    except ValueError as exc:
        raise typer.BadParameter(f"must be NAME:VERSION ({exc})", param_hint="MODEL") from None
    if not ref.pinned:
        raise typer.BadParameter("must be NAME:VERSION", param_hint="MODEL")
    if status not in STATUSES:
        raise typer.BadParameter(f"must be one of {', '.join(STATUSES)}", param_hint="STATUS")
    request = feedback_pb2.SetRewardModelStatusRequest(
        ref=common_pb2.ModelRef(name=ref.name, version=ref.version), status=STATUSES[status]
    )
    reply = _call(target, token, lambda stub: stub.SetRewardModelStatus(request, timeout=10))
    clitools.show_record(_dict(reply.reward_model), as_json)


if __name__ == "__main__":
    app()
