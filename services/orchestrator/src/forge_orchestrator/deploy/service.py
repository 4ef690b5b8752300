"""Deployments behind the orchestrator's API: each is its ``deployment`` workflow
(``deployment-<name>``), started, queried and signalled here.

Deployments need an admin caller: their replicas join the gateway's production pool.
"""

from __future__ import annotations

import dataclasses
import secrets
from datetime import timedelta
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from forge_kit import errors
from forge_orchestrator.deploy.model import (
    SCALE_SIGNAL,
    STATUS_QUERY,
    UNDEPLOY_SIGNAL,
    WORKFLOW_PREFIX,
    WORKFLOW_TYPE,
    DeploymentInput,
    DeploymentStatus,
    validate_deployment,
)
from forge_orchestrator.grant import MEMO_GRANT, sign
from forge_orchestrator.identity import Caller
from forge_orchestrator.service import MEMO_CALLER, MEMO_TEAM

#: Fields a caller sets; the rest (credential, interpreters) are the service's.
_CALLER_FIELDS = (
    "name",
    "team",
    "model",
    "model_dir",
    "engine",
    "min_replicas",
    "max_replicas",
    "replicas",
    "gpu_count",
    "gpu_type",
    "engine_args",
    "autoscale",
)
MAX_LISTED = 1000


def _admin_only(caller: Caller) -> None:
    if not caller.is_admin:
        raise errors.PermissionDeniedError(f"deployments need an admin token; {caller.name} is a team's")


class DeploymentService:
    def __init__(
        self,
        client: Client,
        task_queue: str,
        *,
        forge_python: str = "python",
        vllm_python: str = ".venv-vllm/bin/python",
        poll_s: float = 2.0,
        scale_down_delay_s: float = 60.0,
        grant_key: bytes | None = None,
        rpc_timeout_s: float = 10.0,
    ) -> None:
        self._client = client
        self._task_queue = task_queue
        self._forge_python, self._vllm_python, self._poll_s = forge_python, vllm_python, poll_s
        self._scale_down_delay_s = scale_down_delay_s
        self._grant_key = grant_key
        """Signs each deployment's start grant (:mod:`forge_orchestrator.grant`): without one its
        activities are refused."""
        self._rpc_timeout = timedelta(seconds=rpc_timeout_s)

    def _handle(self, name: str) -> WorkflowHandle[Any, Any]:
        return self._client.get_workflow_handle(WORKFLOW_PREFIX + name)

    async def _status(self, name: str) -> DeploymentStatus:
        try:
            return await self._handle(name).query(
                STATUS_QUERY, result_type=DeploymentStatus, rpc_timeout=self._rpc_timeout
            )
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise errors.NotFoundError(f"deployment {name!r} not found") from None
            raise

    async def deploy(self, spec: DeploymentInput, caller: Caller) -> DeploymentStatus:
        _admin_only(caller)
        if not spec.replicas:
            spec = dataclasses.replace(spec, replicas=spec.min_replicas)
        if not spec.max_replicas:
            spec = dataclasses.replace(spec, max_replicas=max(spec.min_replicas, spec.replicas))
        validate_deployment(spec)
        spec = dataclasses.replace(
            spec,
            replica_token=secrets.token_urlsafe(24),
            forge_python=self._forge_python,
            vllm_python=self._vllm_python,
            poll_s=self._poll_s,
            scale_down_delay_s=self._scale_down_delay_s,
        )
        args: list[object] = [spec, None]
        memo: dict[str, Any] = {MEMO_CALLER: caller.name, MEMO_TEAM: caller.team}
        if self._grant_key is not None:
            payloads = await self._client.data_converter.encode(args)
            memo[MEMO_GRANT] = sign(
                self._grant_key, WORKFLOW_TYPE, WORKFLOW_PREFIX + spec.name, payloads, caller
            )
        try:
            await self._client.start_workflow(
                WORKFLOW_TYPE,
                args=args,
                id=WORKFLOW_PREFIX + spec.name,
                memo=memo,
                task_queue=self._task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                rpc_timeout=self._rpc_timeout,
            )
        except WorkflowAlreadyStartedError:
            current = await self._status(spec.name)
            if any(getattr(current.spec, f) != getattr(spec, f) for f in _CALLER_FIELDS):
                raise errors.AlreadyExistsError(
                    f"deployment {spec.name!r} exists with another spec; undeploy it first"
                ) from None
            return current
        return await self._status(spec.name)

    async def get(self, name: str, caller: Caller) -> DeploymentStatus:
        _admin_only(caller)
        return await self._status(name)

    async def list(self, caller: Caller) -> list[DeploymentStatus]:
        _admin_only(caller)
        query = f"WorkflowType = '{WORKFLOW_TYPE}' AND ExecutionStatus = 'Running'"
        names = []
        async for execution in self._client.list_workflows(query, limit=MAX_LISTED):
            names.append(execution.id.removeprefix(WORKFLOW_PREFIX))
        out = []
        for name in sorted(set(names)):
            try:
                out.append(await self._status(name))
            except errors.NotFoundError:
                continue
        return out

    async def _running(self, name: str) -> DeploymentStatus:
        status = await self._status(name)
        description = await self._handle(name).describe(rpc_timeout=self._rpc_timeout)
        if description.status != WorkflowExecutionStatus.RUNNING:
            raise errors.NotFoundError(f"deployment {name!r} is {status.state}")
        return status

    async def scale(self, name: str, replicas: int, caller: Caller) -> DeploymentStatus:
        _admin_only(caller)
        status = await self._running(name)
        spec = status.spec
        if not spec.min_replicas <= replicas <= spec.max_replicas:
            raise errors.ValidationError(
                "replicas",
                f"must be between {spec.min_replicas} and {spec.max_replicas} (the deployment's min and max)",
            )
        await self._handle(name).signal(SCALE_SIGNAL, replicas, rpc_timeout=self._rpc_timeout)
        return await self._status(name)

    async def undeploy(self, name: str, caller: Caller) -> None:
        _admin_only(caller)
        await self._running(name)
        await self._handle(name).signal(UNDEPLOY_SIGNAL, rpc_timeout=self._rpc_timeout)
