"""A workflow's start grant: who started it, as only the orchestrator's front door can say.

Temporal takes a workflow's input from whoever reaches it (the local dev server has no
authentication), so an identity in the input proves nothing. The front door
(:class:`~forge_orchestrator.service.OrchestratorService`), after authenticating the caller's
token, signs a grant into the workflow's memo: an HMAC-SHA256, with a key only the orchestrator
holds (derived from its service token), over the workflow type, the workflow id, a digest of the
input payloads exactly as Temporal stores them, the caller and the time of issue.

:class:`StartGuard` is a worker interceptor that checks, before every activity runs (every
effect a workflow has — submitting a job, registering or promoting a model — is an activity),
that the workflow asking is one the front door started:

- a workflow without a parent (and not continued from an earlier run) needs a valid grant for
  its own type, id and input, issued within ``max_skew_s`` of its start;
- a child workflow, or a run continued from an earlier one, needs that parent (earlier run) to
  be verified the same way and to run on one of this orchestrator's task queues (so its input
  was written by this code from a verified input, not by a worker of someone else's).

Anything else — no grant, a forged or copied one, a caller set in the input by hand — runs no
activity at all: the activity fails (non-retryable) naming the reason, so the workflow fails
before it submits a job or touches the registry. A missing grant never means admin.
Verdicts are cached per run id.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from forge_orchestrator.identity import Caller

log = structlog.get_logger(__name__)

#: The memo key of a workflow's grant.
MEMO_GRANT = "forge_grant"
_CONTEXT = b"forge-orchestrator workflow grant v1"
#: The longest chain of parents (or earlier runs) followed before a run is refused.
_MAX_DEPTH = 16


def grant_key(service_token: str) -> bytes:
    """The HMAC key of grants, derived from the orchestrator's own service token."""
    if not service_token:
        raise ValueError("the orchestrator's service token is empty: no key to sign workflow grants with")
    return hmac.new(service_token.encode(), _CONTEXT, hashlib.sha256).digest()


def input_digest(payloads: Sequence[Payload]) -> str:
    """SHA-256 over a workflow's input payloads as Temporal stores them (data and metadata)."""
    digest = hashlib.sha256()
    for payload in payloads:
        blob = payload.SerializeToString(deterministic=True)
        digest.update(len(blob).to_bytes(8, "big"))
        digest.update(blob)
    return digest.hexdigest()


def _message(
    workflow_type: str, workflow_id: str, digest: str, caller: Mapping[str, str], issued_at: float
) -> bytes:
    body = {
        "type": workflow_type,
        "id": workflow_id,
        "input": digest,
        "caller": {k: caller.get(k, "") for k in ("name", "role", "team")},
        "issued_at": issued_at,
    }
    return _CONTEXT + b"\n" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(
    key: bytes, workflow_type: str, workflow_id: str, payloads: Sequence[Payload], caller: Caller
) -> dict[str, Any]:
    """The grant (a memo value) for starting ``workflow_type`` as ``workflow_id`` with ``payloads``."""
    who = {"name": caller.name, "role": caller.role, "team": caller.team}
    issued_at = round(time.time(), 3)
    mac = hmac.new(
        key, _message(workflow_type, workflow_id, input_digest(payloads), who, issued_at), "sha256"
    )
    return {"caller": who, "issued_at": issued_at, "signature": mac.hexdigest()}


def check(
    key: bytes,
    grant: object,
    workflow_type: str,
    workflow_id: str,
    payloads: Sequence[Payload],
    started_at: float,
    max_skew_s: float,
) -> Caller:
    """The caller a grant names; raises ``ValueError`` saying why it is not valid for this start."""
    if not isinstance(grant, dict):
        raise ValueError("no grant from the orchestrator's front door")
    caller, issued_at, signature = grant.get("caller"), grant.get("issued_at"), grant.get("signature")
    if (
        not isinstance(caller, dict)
        or not all(isinstance(caller.get(k, ""), str) for k in ("name", "role", "team"))
        or not isinstance(issued_at, int | float)
        or isinstance(issued_at, bool)
        or not isinstance(signature, str)
    ):
        raise ValueError("a malformed grant")
    expected = hmac.new(
        key, _message(workflow_type, workflow_id, input_digest(payloads), caller, float(issued_at)), "sha256"
    ).hexdigest()
    if not hmac.compare_digest(expected, signature):
        raise ValueError("a grant not signed for this workflow's type, id and input")
    if abs(started_at - float(issued_at)) > max_skew_s:
        raise ValueError(f"a grant issued {started_at - float(issued_at):.0f}s from the workflow's start")
    return Caller(name=caller.get("name", ""), role=caller.get("role", ""), team=caller.get("team", ""))


@dataclass(frozen=True)
class _Start:
    """What a run's first history event says about how it was started."""

    workflow_type: str
    task_queue: str
    payloads: Sequence[Payload]
    memo: Mapping[str, Payload]
    parent: tuple[str, str] | None
    previous_run: str
    started_at: float


class StartGuard(Interceptor):
    """Refuses every activity of a workflow the front door did not start (see the module).
    ``task_queues``: the queues this orchestrator's workers poll."""

    def __init__(
        self,
        client: Client,
        key: bytes,
        task_queues: Iterable[str],
        *,
        max_skew_s: float = 600.0,
        max_entries: int = 10_000,
    ) -> None:
        self._client = client
        self._key = key
        self._queues = frozenset(task_queues)
        self._max_skew_s = max_skew_s
        self._max_entries = max_entries
        self._verdicts: dict[str, str] = {}  # run id -> "" (verified) or why not

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Guarded(next, self)

    async def refusal(self, workflow_id: str, run_id: str) -> str:
        """Why the run may not act ("" when it may)."""
        return await self._verdict(workflow_id, run_id, 0)

    async def _verdict(self, workflow_id: str, run_id: str, depth: int) -> str:
        cached = self._verdicts.get(run_id)
        if cached is not None:
            return cached
        if depth > _MAX_DEPTH:
            return "too long a chain of parent workflows"
        try:
            start = await self._start(workflow_id, run_id)
            verdict = await self._judge(workflow_id, start, depth)
        except ValueError as exc:
            verdict = str(exc) or "refused"
        if len(self._verdicts) >= self._max_entries:
            self._verdicts.clear()
        self._verdicts[run_id] = verdict
        return verdict

    async def _judge(self, workflow_id: str, start: _Start, depth: int) -> str:
        origin = start.parent or ((workflow_id, start.previous_run) if start.previous_run else None)
        if origin is not None:
            what = "parent workflow" if start.parent else "earlier run"
            origin_start = await self._start(*origin)
            if origin_start.task_queue not in self._queues:
                return f"its {what} {origin[0]!r} runs on task queue {origin_start.task_queue!r}, not this orchestrator's"
            why = await self._verdict(origin[0], origin[1], depth + 1)
            return f"its {what} {origin[0]!r}: {why}" if why else ""
        raw = start.memo.get(MEMO_GRANT)
        grant = self._client.data_converter.payload_converter.from_payloads([raw])[0] if raw else None
        caller = check(
            self._key,
            grant,
            start.workflow_type,
            workflow_id,
            start.payloads,
            start.started_at,
            self._max_skew_s,
        )
        log.debug("workflow.grant_verified", workflow_id=workflow_id, caller=caller.name)
        return ""

    async def _start(self, workflow_id: str, run_id: str) -> _Start:
        handle = self._client.get_workflow_handle(workflow_id, run_id=run_id)
        async for event in handle.fetch_history_events(page_size=1):
            if not event.HasField("workflow_execution_started_event_attributes"):
                break
            a = event.workflow_execution_started_event_attributes
            parent = (
                (a.parent_workflow_execution.workflow_id, a.parent_workflow_execution.run_id)
                if a.HasField("parent_workflow_execution") and a.parent_workflow_execution.workflow_id
                else None
            )
            return _Start(
                workflow_type=a.workflow_type.name,
                task_queue=a.task_queue.name,
                payloads=list(a.input.payloads),
                memo=dict(a.memo.fields),
                parent=parent,
                previous_run=a.continued_execution_run_id,
                started_at=event.event_time.ToNanoseconds() / 1e9 if event.HasField("event_time") else 0.0,
            )
        raise ValueError(f"no start event in the history of {workflow_id!r}")


class _Guarded(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, guard: StartGuard) -> None:
        super().__init__(next)
        self._guard = guard

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        why = await self._guard.refusal(info.workflow_id or "", info.workflow_run_id or "")
        if why:
            log.warning(
                "workflow.unverified",
                workflow_id=info.workflow_id,
                workflow_type=info.workflow_type,
                activity=info.activity_type,
                reason=why,
            )
            raise ApplicationError(
                f"refused: workflow {info.workflow_id!r} was not started through the orchestrator's API ({why})",
                type="UnverifiedWorkflow",
                non_retryable=True,
            )
        return await super().execute_activity(input)
