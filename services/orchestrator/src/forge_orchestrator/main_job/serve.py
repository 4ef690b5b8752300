"""The main job's ``serve`` step (order 42, right after ``train``): the trained model on vLLM; and
``retire`` (order 15), which undeploys an earlier ``forge up``'s.

vLLM takes a minute or more to start on a CPU, so the step deploys the train step's export as
soon as it exists and does not wait: the replica starts while ``tracking`` and ``eval`` run, and
the ``chat`` step (:mod:`.chat`) waits for it to be ready.

1. take the export and its identity: the orchestrator names a checkpoint ``<run>:step-<n>`` in
   eval's registry (the train step's ``checkpoint_id``);
2. deploy it through the orchestrator's Deploy API as the deployment ``main-job-chat`` (engine
   vLLM, one replica of one simulated GPU of team ``main-job``): its driver workflow submits the
   replica as a production inference job, the scheduler places it, a trainer agent starts vLLM
   on a port it assigns, and the replica joins the gateway's pool once it answers. A deployment
   of that name left by an earlier ``forge up`` (another model) is undeployed first. Where
   promotions roll replicas (``forge up``), the checkpoint's eval-and-promote workflow usually
   deployed it already, for its release runs (``<run>-step-<n>``, vLLM): the step reports that
   deployment instead of making a second one.

Deployments outlive ``forge down``: at the next ``forge up`` the driver workflow places the
earlier run's replica again, and vLLM would start while the new model trains, only to be replaced
by ``serve``. So ``retire``, before ``train``, undeploys ``main-job-chat`` (``main-job-production``
stays: the ``chat`` step decides whether production still needs it).

:class:`Deployments` is the small client of the Deploy API these steps and ``chat`` use.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import MainJobContext
from forge_kit.modelref import ModelRef

#: The deployment of the train step's model.
DEPLOYMENT = "main-job-chat"
#: The train step's team and GPU type: ``forge up``'s agents have one simulated GPU each.
TEAM = "main-job"
GPU_TYPE = "SIM"
#: vLLM's flags for the main job's replicas: a small model on a small machine, so few sequences.
ENGINE_ARGS = ["--max-num-seqs", "16"]
RPC_S = 30.0
POLL_S = 1.0
#: vLLM starts in 60-75 s on an idle 2-core machine; the main job's other steps share the cores.
READY_WAIT_S = 420.0
GONE_WAIT_S = 90.0


class ServeStepError(RuntimeError):
    """A deployment of the main job could not be made or did not become ready; says why."""


class DeploymentGoneError(ServeStepError):
    """The deployment waited for no longer exists (e.g. a rolled-back canary's, drained)."""


@dataclass(frozen=True)
class Servable:
    """A checkpoint folder on this machine and the registry identity it is served under."""

    model: ModelRef
    path: Path
    why: str
    """``trained``, or the registry stage it holds."""


def trained_export(ctx: MainJobContext) -> Servable:
    """The train step's export (absolute folder) and its registry identity (``checkpoint_id``)."""
    train = ctx.results.get("train") or {}
    uri, checkpoint_id = train.get("checkpoint_uri"), train.get("checkpoint_id")
    if not uri or not isinstance(checkpoint_id, str):
        raise ServeStepError(
            "no trained checkpoint to serve: the `train` step's result has no checkpoint_uri and "
            f"checkpoint_id (steps that ran: {', '.join(ctx.results) or 'none'})"
        )
    path = Path(str(uri).removeprefix("file://"))
    try:
        model = ModelRef.parse(checkpoint_id)
    except ValueError as exc:
        raise ServeStepError(f"the `train` step reported an invalid checkpoint_id: {exc}") from None
    return Servable(model, path if path.is_absolute() else ctx.root / path, "trained")


def spec_of(name: str, item: Servable) -> orchestrator_pb2.DeploymentSpec:
    """The main job's deployment of ``item``: vLLM, one replica on one of the agents' GPUs."""
    return orchestrator_pb2.DeploymentSpec(
        name=name,
        team=TEAM,
        model=str(item.model),
        model_dir=str(item.path),
        engine=orchestrator_pb2.ENGINE_VLLM,
        min_replicas=1,
        max_replicas=1,
        replicas=1,
        resources=common_pb2.ResourceRequest(gpu_count=1, gpu_type=GPU_TYPE),
        engine_args=ENGINE_ARGS,
    )


class Deployments:
    """The orchestrator's Deploy API as the main job uses it; ``async with``."""

    def __init__(self, target: str, token: str) -> None:
        self._channel = make_channel(target, token=token)
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    async def __aenter__(self) -> Deployments:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._channel.close(None)

    async def get(self, name: str) -> orchestrator_pb2.Deployment | None:
        """The deployment, or None when there is none (never made, or undeployed)."""
        try:
            reply = await self._stub.GetDeployment(
                orchestrator_pb2.GetDeploymentRequest(name=name), timeout=RPC_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return None if reply.deployment.state == "undeployed" else reply.deployment

    async def serving(self, model: ModelRef) -> orchestrator_pb2.Deployment | None:
        """A live deployment of ``model`` (``name:version``), whoever made it, or None."""
        reply = await self._stub.ListDeployments(orchestrator_pb2.ListDeploymentsRequest(), timeout=RPC_S)
        for deployment in reply.deployments:
            if deployment.spec.model == str(model) and deployment.state not in ("undeploying", "undeployed"):
                return deployment
        return None

    async def ensure(self, spec: orchestrator_pb2.DeploymentSpec) -> tuple[orchestrator_pb2.Deployment, bool]:
        """Deploy ``spec``; a deployment of that name with another spec is undeployed first.
        The deployment, and whether one was replaced."""
        request = orchestrator_pb2.DeployRequest(spec=spec)
        try:
            return (await self._stub.Deploy(request, timeout=RPC_S)).deployment, False
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
        await self.remove(spec.name)
        return (await self._stub.Deploy(request, timeout=RPC_S)).deployment, True

    async def remove(self, name: str) -> bool:
        """Undeploy ``name`` and wait until its replicas are gone; False when there was none."""
        try:
            await self._stub.Undeploy(orchestrator_pb2.UndeployRequest(name=name), timeout=RPC_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        deadline = time.monotonic() + GONE_WAIT_S
        while await self.get(name) is not None:
            if time.monotonic() > deadline:
                raise ServeStepError(f"deployment {name} still undeploying after {GONE_WAIT_S:g}s")
            await asyncio.sleep(POLL_S)
        return True

    async def wait_ready(self, name: str, timeout_s: float = READY_WAIT_S) -> orchestrator_pb2.Deployment:
        """Poll until a replica of ``name`` is in the gateway's pool."""
        deadline = time.monotonic() + timeout_s
        while True:
            deployment = await self.get(name)
            if deployment is None:
                raise DeploymentGoneError(f"deployment {name} does not exist")
            if deployment.ready_replicas >= 1:
                return deployment
            if time.monotonic() > deadline:
                replicas = ", ".join(replica_lines(deployment)) or "none"
                raise ServeStepError(
                    f"deployment {name} has no ready replica after {timeout_s:g}s "
                    f"({deployment.state}: {deployment.message or 'no message'}; replicas: {replicas})"
                )
            await asyncio.sleep(POLL_S)


def replica_lines(deployment: orchestrator_pb2.Deployment) -> list[str]:
    """Each replica in a line: its job, state, node and endpoint."""
    return [
        f"{r.job_id} {r.state} on {r.node or '-'}" + (f" at {r.endpoint}" if r.endpoint else "")
        for r in deployment.replicas
    ]


def describe(deployment: orchestrator_pb2.Deployment) -> dict[str, object]:
    """A deployment as a step's table shows it."""
    return {
        "name": deployment.spec.name,
        "model": deployment.spec.model,
        "engine": orchestrator_pb2.Engine.Name(deployment.spec.engine).removeprefix("ENGINE_").lower(),
        "state": deployment.state,
        "replicas": replica_lines(deployment),
    }


async def serve(ctx: MainJobContext) -> dict[str, object]:
    # 1. The export and its identity.
    trained = trained_export(ctx)
    # 2. Its deployment; the chat step waits for it. Where promotions roll replicas, the
    # eval-and-promote workflow of this checkpoint may have deployed it already for its release
    # runs: that deployment serves it, rather than a second set of replicas.
    orchestrator = ctx.endpoint("orchestrator")
    async with Deployments(orchestrator.grpc_target, orchestrator.token) as deployments:
        existing = await deployments.serving(trained.model)
        if existing is not None and existing.spec.name != DEPLOYMENT:
            await deployments.remove(DEPLOYMENT)
            deployment, replaced = existing, False
        else:
            deployment, replaced = await deployments.ensure(spec_of(DEPLOYMENT, trained))
    return {
        "ok": True,
        "deployment": deployment.spec.name,
        "model": str(trained.model),
        "model_dir": str(trained.path),
        "engine": "vllm",
        "engine_args": " ".join(ENGINE_ARGS),
        "replaced_earlier": replaced,
        "state": deployment.state,
        "note": "vLLM starts while the next steps run; the chat step waits for its replica",
    }


serve.order = 42  # type: ignore[attr-defined]
serve.timeout_s = GONE_WAIT_S + 3 * RPC_S  # type: ignore[attr-defined]


async def retire(ctx: MainJobContext) -> dict[str, object]:
    """Undeploy the earlier run's ``main-job-chat`` (see the module docstring)."""
    orchestrator = ctx.endpoint("orchestrator")
    async with Deployments(orchestrator.grpc_target, orchestrator.token) as deployments:
        earlier = await deployments.get(DEPLOYMENT)
        removed = await deployments.remove(DEPLOYMENT)
    return {
        "ok": True,
        "undeployed": f"{DEPLOYMENT} ({earlier.spec.model})" if removed and earlier is not None else "none",
    }


retire.order = 15  # type: ignore[attr-defined]
retire.timeout_s = GONE_WAIT_S + 3 * RPC_S  # type: ignore[attr-defined]
