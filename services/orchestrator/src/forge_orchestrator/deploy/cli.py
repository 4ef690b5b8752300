"""``forge serve …``: deploy a model on scheduled replicas, list, scale and undeploy deployments.

The orchestrator and its token are found as for ``forge workflows`` (``--target``,
``$FORGE_CLI_ORCHESTRATOR_TARGET``, ``$FORGE_CLI_ORCHESTRATOR_TOKEN``, ``var/secrets/tokens.json``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import typer
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format

from forge_kit import clitools
from forge_kit.grpckit import make_channel
from forge_orchestrator.cli import JsonOption, TargetOption, TokenOption, resolve_token

app = typer.Typer(
    help="Model deployments: replicas placed by the scheduler, routed by the gateway.", no_args_is_help=True
)
RPC_TIMEOUT_S = 30.0
T = TypeVar("T")
_ENGINES = {"forge": orchestrator_pb2.ENGINE_FORGE, "vllm": orchestrator_pb2.ENGINE_VLLM}


def _call(
    target: str, token: str, rpc: Callable[[orchestrator_pb2_grpc.OrchestratorServiceAsyncStub], Awaitable[T]]
) -> T:
    async def go() -> T:
        async with make_channel(target, token=resolve_token(token)) as channel:
            return await rpc(orchestrator_pb2_grpc.OrchestratorServiceStub(channel))

    return clitools.run_rpc(go())


def _rows(deployments: list[orchestrator_pb2.Deployment]) -> list[dict[str, Any]]:
    return [
        {
            "name": d.spec.name,
            "model": d.spec.model,
            "engine": orchestrator_pb2.Engine.Name(d.spec.engine).removeprefix("ENGINE_").lower(),
            "state": d.state,
            "ready": f"{d.ready_replicas}/{d.desired_replicas}",
            "min_max": f"{d.spec.min_replicas}-{d.spec.max_replicas}",
            "replicas": ", ".join(
                f"{r.job_id}:{r.state}" + (f"@{r.endpoint}" if r.endpoint else "") for r in d.replicas
            ),
            "message": d.message,
        }
        for d in deployments
    ]


def _show(deployments: list[orchestrator_pb2.Deployment], as_json: bool) -> None:
    if as_json:
        clitools.show_rows([json_format.MessageToDict(d) for d in deployments], [], True)
        return
    clitools.show_rows(
        _rows(deployments),
        ["name", "model", "engine", "state", "ready", "min_max", "replicas", "message"],
        False,
    )


@app.command()
def deploy(
    name: Annotated[str, typer.Argument(help="Deployment name (lowercase letters, digits, '-').")],
    model: Annotated[str, typer.Option("--model", help="Model served: name or name:version.")],
    model_dir: Annotated[str, typer.Option("--model-dir", help="Hugging Face model folder on the nodes.")],
    team: Annotated[str, typer.Option("--team", help="Team charged for the replicas.")],
    engine: Annotated[str, typer.Option("--engine", help="forge or vllm.")] = "forge",
    replicas: Annotated[int, typer.Option("--replicas", min=0, help="Replicas to start with (0: min).")] = 0,
    min_replicas: Annotated[int, typer.Option("--min", min=1)] = 1,
    max_replicas: Annotated[int, typer.Option("--max", min=0, help="0: the larger of min and replicas.")] = 0,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs per replica.")] = 1,
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="GPU type per replica.")] = "",
    engine_arg: Annotated[
        list[str] | None, typer.Option("--engine-arg", help="Engine argument (repeatable).")
    ] = None,
    autoscale: Annotated[bool, typer.Option(help="Follow the gateway's desired replica count.")] = False,
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Deploy a model; its replicas are placed by the scheduler and join the gateway when ready."""
    if engine not in _ENGINES:
        raise typer.BadParameter(f"must be one of {', '.join(_ENGINES)}", param_hint="--engine")
    spec = orchestrator_pb2.DeploymentSpec(
        name=name,
        team=team,
        model=model,
        model_dir=model_dir,
        engine=_ENGINES[engine],
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        replicas=replicas,
        resources=common_pb2.ResourceRequest(gpu_count=gpus, gpu_type=gpu_type),
        engine_args=engine_arg or [],
        autoscale=autoscale,
    )
    reply = _call(
        target, token, lambda s: s.Deploy(orchestrator_pb2.DeployRequest(spec=spec), timeout=RPC_TIMEOUT_S)
    )
    _show([reply.deployment], as_json)


@app.command("list")
def list_(
    target: TargetOption = "127.0.0.1:50059", token: TokenOption = "", as_json: JsonOption = False
) -> None:
    """Live deployments with their replicas."""
    reply = _call(
        target,
        token,
        lambda s: s.ListDeployments(orchestrator_pb2.ListDeploymentsRequest(), timeout=RPC_TIMEOUT_S),
    )
    _show(list(reply.deployments), as_json)


@app.command()
def scale(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    replicas: Annotated[int, typer.Argument(min=0, help="Desired replicas (within its min and max).")],
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Set a deployment's desired replicas."""
    request = orchestrator_pb2.ScaleDeploymentRequest(name=name, replicas=replicas)
    reply = _call(target, token, lambda s: s.ScaleDeployment(request, timeout=RPC_TIMEOUT_S))
    _show([reply.deployment], as_json)


@app.command()
def undeploy(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    target: TargetOption = "127.0.0.1:50059",
    token: TokenOption = "",
) -> None:
    """Drain every replica (out of the gateway, then stopped) and end the deployment."""
    _call(
        target,
        token,
        lambda s: s.Undeploy(orchestrator_pb2.UndeployRequest(name=name), timeout=RPC_TIMEOUT_S),
    )
    typer.echo(f"undeploying {name}")
