"""Activities that let a promotion roll replicas: the eval-and-promote workflow asks for a
deployment of the version it promotes, waits for it to be ready, and drains the version that lost.

Every replica is run by a ``deployment`` workflow (:mod:`forge_orchestrator.deploy.workflow`, started
through :class:`~forge_orchestrator.deploy.service.DeploymentService` exactly as ``forge serve
deploy`` starts one); these activities only start, read and undeploy deployments, and read the
gateway's aliases to know when a version no longer gets traffic.

- ``promotion_serve``: the running deployment that serves ``name:version``, else a new one from
  :class:`PromotionServing` (the orchestrator's settings) named after the version. With the
  ``forge`` engine the checkpoint folder is laid out as the model server reads a version (a folder
  named after the model, links to the checkpoint's files, ``forge_model.json`` with the version),
  so the gateway routes ``name:version`` to these replicas only. Disabled (no serving
  configured): nothing is deployed and the workflow promotes as before.
- ``promotion_status``: whether the deployment has all its replicas in the gateway's pool.
- ``promotion_routed``: whether any gateway alias still sends traffic to ``name:version``.
- ``promotion_drain``: undeploy every running deployment serving ``name:version`` (each drains
  its replicas out of the pool before their jobs are cancelled); one already undeploying counts
  as drained.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit import errors
from forge_kit.modelref import ModelRef
from forge_orchestrator.config import OrchestratorSettings
from forge_orchestrator.deploy.model import DeploymentInput
from forge_orchestrator.identity import Caller

if TYPE_CHECKING:
    # The service imports the workflows, whose promotion steps import this module.
    from forge_orchestrator.deploy.service import DeploymentService

#: Who promotions deploy as (the eval-and-promote workflow needs an admin to start).
PROMOTION_CALLER = Caller(name="eval_and_promote", role="admin")
VERSION_FILE = "forge_model.json"
_NOT_NAME = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class PromotionServing:
    """How a promoted version is deployed (the orchestrator's ``promote_deploy_*`` settings)."""

    team: str
    gpu_type: str
    engine: str = "forge"
    replicas: int = 1
    max_replicas: int = 0
    """Above ``replicas``: the deployment autoscales between the two; 0: a fixed count."""
    gpu_count: int = 1
    engine_args: tuple[str, ...] = ()
    layout_dir: str = "var/data/promoted"
    """Where ``forge``-engine model folders are laid out; nodes must see the same path."""
    ready_timeout_s: float = 900.0
    """How long a promotion waits for the version's replicas before it gives up."""


@dataclass
class ServeInput:
    model: str
    """``name:version``."""
    uri: str
    """The registered checkpoint: a local folder or ``file://`` URL."""


@dataclass
class Served:
    deployment: str = ""
    """The deployment serving the version; empty: promotions deploy nothing here."""
    ready: bool = False
    message: str = ""
    ready_timeout_s: float = 0.0
    created: bool = False
    """This call deployed it (False: it found a running deployment of the version, made by a
    person, another promotion or the main job, which is not its to undeploy when the release is
    blocked)."""


@dataclass
class Drained:
    deployments: list[str] = field(default_factory=list)


def promotion_serving(settings: OrchestratorSettings) -> PromotionServing | None:
    """How promotions deploy a version (None: they roll no replicas)."""
    if not settings.promote_deploy:
        return None
    return PromotionServing(
        team=settings.promote_deploy_team,
        gpu_type=settings.promote_deploy_gpu_type,
        engine=settings.promote_deploy_engine,
        replicas=settings.promote_deploy_replicas,
        max_replicas=settings.promote_deploy_max_replicas,
        gpu_count=settings.promote_deploy_gpu_count,
        engine_args=tuple(settings.promote_deploy_engine_args),
        layout_dir=settings.promote_deploy_dir or str(Path(settings.data_dir) / "promoted"),
        ready_timeout_s=settings.promote_deploy_ready_timeout_s,
    )


def promotion_deployment(serving: PromotionServing, model: ModelRef, model_dir: Path) -> DeploymentInput:
    """The deployment of ``model`` (served from ``model_dir``) that a promotion starts: ``replicas``
    of them, autoscaled up to ``max_replicas`` when that is more."""
    return DeploymentInput(
        name=deployment_name(model),
        team=serving.team,
        model=str(model),
        model_dir=str(model_dir),
        engine=serving.engine,
        min_replicas=serving.replicas,
        max_replicas=max(serving.replicas, serving.max_replicas),
        autoscale=serving.max_replicas > serving.replicas,
        replicas=serving.replicas,
        gpu_count=serving.gpu_count,
        gpu_type=serving.gpu_type,
        engine_args=list(serving.engine_args),
    )


def deployment_name(model: ModelRef) -> str:
    """``<name>-<version>`` as a deployment name; a digest keeps names that had to change distinct."""
    plain = f"{model.name}-{model.version}" if model.version else model.name
    base = _NOT_NAME.sub("-", plain.lower()).strip("-")
    if base == plain and len(base) <= 52:
        return base
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:8]
    return f"{base[:43].strip('-')}-{digest}".strip("-")


def lay_out(root: Path, model: ModelRef, checkpoint: Path) -> Path:
    """``root/<deployment>/<name>/``: links to the checkpoint's files and the version file."""
    folder = root / deployment_name(model) / model.name
    folder.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name == VERSION_FILE:
            continue
        link = folder / item.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(item.resolve())
    (folder / VERSION_FILE).write_text(json.dumps({"version": model.version}))
    return folder


def _checkpoint(uri: str) -> Path:
    path = Path(uri.removeprefix("file://"))
    if not path.is_absolute() or not (path / "config.json").is_file():
        raise ApplicationError(
            f"cannot deploy {uri!r}: replicas serve a local Hugging Face folder (with config.json)",
            type="NotServable",
            non_retryable=True,
        )
    return path.resolve()


class PromotionActivities:
    """The activities above; ``deployments`` None (or no ``serving``): promotions deploy nothing."""

    def __init__(
        self,
        deployments: DeploymentService | None = None,
        serving: PromotionServing | None = None,
        *,
        gateway_url: str = "",
        gateway_token: str = "",
        timeout_s: float = 10.0,
    ) -> None:
        self._deployments = deployments if serving is not None else None
        self._serving = serving
        self._gateway_url = gateway_url.rstrip("/")
        self._gateway_token = gateway_token
        self._timeout_s = timeout_s

    def methods(self) -> list[Callable[..., Any]]:
        return [self.serve, self.status, self.routed, self.drain]

    @activity.defn(name="promotion_serve")
    async def serve(self, params: ServeInput) -> Served:
        if self._deployments is None or self._serving is None:
            return Served()
        serving = self._serving
        model = ModelRef.parse(params.model)
        for status in await self._deployments.list(PROMOTION_CALLER):
            if status.spec.model == str(model) and status.state != "undeploying":
                return Served(
                    status.spec.name, status.state == "ready", status.message, serving.ready_timeout_s
                )
        checkpoint = _checkpoint(params.uri)
        model_dir = checkpoint
        if serving.engine == "forge":
            model_dir = lay_out(Path(serving.layout_dir).resolve(), model, checkpoint)
        spec = promotion_deployment(serving, model, model_dir)
        try:
            status = await self._deployments.deploy(spec, PROMOTION_CALLER)
        except (errors.ValidationError, errors.AlreadyExistsError) as exc:
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc
        return Served(spec.name, status.state == "ready", status.message, serving.ready_timeout_s, True)

    @activity.defn(name="promotion_status")
    async def status(self, deployment: str) -> Served:
        assert self._deployments is not None and self._serving is not None
        try:
            status = await self._deployments.get(deployment, PROMOTION_CALLER)
        except errors.NotFoundError as exc:
            return Served(deployment, False, str(exc), self._serving.ready_timeout_s)
        ready = status.state == "ready" and status.ready_replicas >= status.desired_replicas > 0
        return Served(deployment, ready, status.message, self._serving.ready_timeout_s)

    @activity.defn(name="promotion_routed")
    async def routed(self, model: str) -> bool:
        """Whether a gateway alias names ``model`` as its stable model or splits traffic to it."""
        if self._deployments is None or not self._gateway_url:
            return False
        async with httpx.AsyncClient(
            base_url=self._gateway_url,
            headers={"Authorization": f"Bearer {self._gateway_token}"},
            timeout=self._timeout_s,
        ) as admin:
            reply = await admin.get("/admin/v1/aliases")
        if reply.status_code != 200:
            raise ApplicationError(f"gateway aliases: HTTP {reply.status_code}: {reply.text[:300]}")
        ref = ModelRef.parse(model)
        for alias in reply.json().get("aliases", []):
            stable = alias.get("model") or {}
            if (stable.get("name"), stable.get("version") or "") == (ref.name, ref.version):
                return True
            canary = alias.get("canary") or {}
            split = canary.get("model") or {}
            if canary.get("weight") and (split.get("name"), split.get("version") or "") == (
                ref.name,
                ref.version,
            ):
                return True
        return False

    @activity.defn(name="promotion_drain")
    async def drain(self, model: str) -> Drained:
        if self._deployments is None:
            return Drained()
        out = Drained()
        for status in await self._deployments.list(PROMOTION_CALLER):
            if status.spec.model != model or status.state == "undeployed":
                continue
            # One already undeploying is being drained by its driver: an earlier call for the same
            # loser did it (eval-and-promote and the ModelPromoted rollout both drain a loser).
            if status.state != "undeploying":
                try:
                    await self._deployments.undeploy(status.spec.name, PROMOTION_CALLER)
                except errors.NotFoundError:
                    continue
            out.deployments.append(status.spec.name)
        return out
