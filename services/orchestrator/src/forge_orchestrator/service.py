"""Orchestrator domain logic: start, inspect and cancel workflows.

:class:`OrchestratorService` is the workflow front door behind the gRPC API: it validates the
workflow type and its input, starts it on its kind's task queue (the main worker's, or
``<queue>-rlhf`` for the RLHF loop) and returns at once.
The handlers of its Kafka consumer, which route job events and checkpoints to workflows, are in
:mod:`forge_orchestrator.event_handlers`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, get_args, get_origin, get_type_hints

import structlog
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, FailureError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode, TLSConfig
from temporalio.worker import Interceptor, Worker

from forge_kit import errors
from forge_kit.backoff import Backoff
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.cpt.model import CptInput, validate_cpt
from forge_orchestrator.cpt.workflow import CptWorkflow
from forge_orchestrator.deploy.promoted import (
    PromotionRolloutInput,
    PromotionRolloutWorkflow,
    validate_promotion_rollout,
)
from forge_orchestrator.deploy.promotion import PromotionActivities
from forge_orchestrator.deploy.workflow import DeploymentWorkflow
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.grant import MEMO_GRANT, sign
from forge_orchestrator.identity import ADMIN, Caller, authorize_start
from forge_orchestrator.inbox import PROGRESS_QUERY
from forge_orchestrator.promote.canary_activities import CanaryActivities
from forge_orchestrator.promote.model import EvalAndPromoteInput
from forge_orchestrator.promote.service import validate_eval_and_promote
from forge_orchestrator.promote.workflow import EvalAndPromoteWorkflow
from forge_orchestrator.rlhf.worker import rlhf_task_queue, validate_rlhf
from forge_orchestrator.rlhf.workflow import RlhfInput, RlhfWorkflow
from forge_orchestrator.smoke.model import SmokeInput
from forge_orchestrator.smoke.service import validate_smoke
from forge_orchestrator.smoke.workflow import SmokeWorkflow
from forge_orchestrator.sweep.service import sweep_memo, validate_sweep
from forge_orchestrator.sweep.workflow import SweepInput, SweepWorkflow
from forge_orchestrator.synthetic.model import SyntheticInput, validate_synthetic
from forge_orchestrator.synthetic.worker import synthetic_task_queue
from forge_orchestrator.synthetic.workflow import SyntheticWorkflow
from forge_orchestrator.training.model import TrainInput
from forge_orchestrator.training.service import validate_train
from forge_orchestrator.training.workflow import TrainWorkflow
from forge_orchestrator.vlm_curriculum.model import VlmCurriculumInput, validate_vlm_curriculum
from forge_orchestrator.vlm_curriculum.workflow import VlmCurriculumWorkflow

log = structlog.get_logger(__name__)

#: Memo keys of every workflow the API starts: who started it and the team it acts for.
MEMO_CALLER, MEMO_TEAM = "forge_caller", "forge_team"
_WORKFLOW_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,79}$")


def _main_queue(task_queue: str) -> str:
    return task_queue


@dataclass(frozen=True)
class WorkflowKind:
    """A workflow the API can start: its Temporal type name, input dataclass, input check, and
    the task queue it starts on (a function of the service's queue)."""

    name: str
    workflow: type
    input: type
    validate: Callable[[Any], None]
    queue: Callable[[str], str] = _main_queue
    """Which worker runs it: the main worker's queue, or a separate worker's (``<queue>-rlhf``)."""
    memo: Callable[[Any], dict[str, str]] = lambda _: {}
    """Extra memo entries from the validated input (a sweep's followed metric)."""


KINDS: dict[str, WorkflowKind] = {
    "smoke": WorkflowKind("smoke", SmokeWorkflow, SmokeInput, validate_smoke),
    "training": WorkflowKind("training", TrainWorkflow, TrainInput, validate_train),
    "eval_and_promote": WorkflowKind(
        "eval_and_promote", EvalAndPromoteWorkflow, EvalAndPromoteInput, validate_eval_and_promote
    ),
    "sweep": WorkflowKind("sweep", SweepWorkflow, SweepInput, validate_sweep, memo=sweep_memo),
    "vlm_curriculum": WorkflowKind(
        "vlm_curriculum", VlmCurriculumWorkflow, VlmCurriculumInput, validate_vlm_curriculum
    ),
    "cpt": WorkflowKind("cpt", CptWorkflow, CptInput, validate_cpt),
    # Started by the ModelPromoted consumer (event_handlers.PromotionHandler); an admin may re-run one.
    "promotion_rollout": WorkflowKind(
        "promotion_rollout", PromotionRolloutWorkflow, PromotionRolloutInput, validate_promotion_rollout
    ),
    # Run by the RLHF worker (rlhf/worker.py) on its own queue, with its children.
    "rlhf": WorkflowKind("rlhf", RlhfWorkflow, RlhfInput, validate_rlhf, queue=rlhf_task_queue),
    # Run by the synthetic-data worker (synthetic/worker.py) on its own queue, with its children.
    "synthetic": WorkflowKind(
        "synthetic", SyntheticWorkflow, SyntheticInput, validate_synthetic, queue=synthetic_task_queue
    ),
}

#: Every workflow class the main worker runs (the kinds started on the main queue).
WORKFLOWS: tuple[type, ...] = (
    *(k.workflow for k in KINDS.values() if k.queue is _main_queue),
    DeploymentWorkflow,
)


def _coerce(path: str, hint: Any, value: object) -> object:
    """``value`` (decoded JSON) as ``hint``; numbers from a Struct arrive as floats."""
    origin = get_origin(hint)
    if hint is str:
        if isinstance(value, str):
            return value
        raise errors.ValidationError(path, "must be a string")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise errors.ValidationError(path, "must be a boolean")
    if hint is int:
        if isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
        raise errors.ValidationError(path, "must be an integer")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise errors.ValidationError(path, "must be a number")
    if origin is list:
        if not isinstance(value, list):
            raise errors.ValidationError(path, "must be a list")
        (item,) = get_args(hint)
        return [_coerce(f"{path}[{i}]", item, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise errors.ValidationError(path, "must be an object")
        _, item = get_args(hint)
        return {str(k): _coerce(f"{path}.{k}", item, v) for k, v in value.items()}
    if origin is tuple and get_args(hint)[1:] == (Ellipsis,):
        if not isinstance(value, list):
            raise errors.ValidationError(path, "must be a list")
        return tuple(_coerce(f"{path}[{i}]", get_args(hint)[0], v) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):  # a nested section (cpt's rule)
        if not isinstance(value, dict):
            raise errors.ValidationError(path, "must be an object")
        return parse_input(hint, value, path)
    raise errors.ValidationError(path, f"has an unsupported type {hint!r}")


def parse_input(cls: type, data: Mapping[str, object], path: str = "input") -> Any:
    """Build the input dataclass ``cls`` from JSON, naming the offending field on any error."""
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise errors.ValidationError(
            f"{path}.{unknown[0]}", f"is not a field of {cls.__name__} ({', '.join(sorted(fields))})"
        )
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise errors.ValidationError(f"{path}.{missing[0]}", "required")
    values = {name: _coerce(f"{path}.{name}", hints[name], value) for name, value in data.items()}
    try:
        return cls(**values)
    except TypeError as exc:  # a check of the dataclass's own
        raise errors.ValidationError(path, str(exc)) from None


def to_json(value: object) -> dict[str, Any]:
    """A workflow result as a JSON object (dataclasses are encoded by field)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return value
    return {"value": value}


@dataclass(frozen=True)
class WorkflowView:
    """What GetWorkflow reports about one run."""

    workflow_id: str
    run_id: str
    workflow_type: str
    status: WorkflowExecutionStatus
    result: dict[str, Any] | None = None
    error: str = ""
    progress: dict[str, Any] | None = None
    started_at: dt.datetime | None = None
    closed_at: dt.datetime | None = None


def failure_message(exc: BaseException) -> str:
    """The chain of Temporal failure messages, outermost first: ``activity error: CancelJob: …``."""
    parts: list[str] = []
    current: BaseException | None = exc.cause if isinstance(exc, WorkflowFailureError) else exc
    while current is not None:
        if isinstance(current, ActivityError):
            message = f"activity {current.activity_type} failed"
        else:
            message = current.message if isinstance(current, FailureError) else str(current)
        if message and message not in parts:
            parts.append(message)
        current = current.cause if isinstance(current, FailureError) else current.__cause__
    return ": ".join(parts) or type(exc).__name__


class OrchestratorService:
    """Starts workflows on their kind's task queue (derived from ``task_queue``) and reports on
    them; every call is one or two Temporal RPCs. ``kinds`` are the workflows this deployment
    runs (the RLHF kind only where its worker is enabled). With ``grant_key`` every start carries
    a grant signed with it (:mod:`forge_orchestrator.grant`), without which the workers'
    :class:`~forge_orchestrator.grant.StartGuard` lets the workflow do nothing."""

    def __init__(
        self,
        client: Client,
        task_queue: str,
        *,
        grant_key: bytes | None = None,
        kinds: Mapping[str, WorkflowKind] = KINDS,
        rpc_timeout_s: float = 10.0,
        query_timeout_s: float = 2.0,
    ) -> None:
        self._client = client
        self._task_queue = task_queue
        self._kinds = kinds
        self._grant_key = grant_key
        self._rpc_timeout = timedelta(seconds=rpc_timeout_s)
        self._query_timeout = timedelta(seconds=query_timeout_s)

    async def start_workflow(
        self, workflow_type: str, data: Mapping[str, object], workflow_id: str = "", caller: Caller = ADMIN
    ) -> tuple[str, str]:
        """Start ``workflow_type`` for ``caller`` (its identity goes into the input; see
        :mod:`forge_orchestrator.identity` for what it may ask); returns (workflow id, run id).
        Idempotent when ``workflow_id`` is given: an existing workflow with that id, running or
        closed, is returned, not re-run."""
        kind = self._kinds.get(workflow_type)
        if kind is None:
            disabled = " (its worker is disabled here)" if workflow_type in KINDS else ""
            raise errors.ValidationError(
                "workflow_type",
                f"unknown workflow type {workflow_type!r}{disabled}; known: {', '.join(sorted(self._kinds))}",
            )
        if workflow_id and not _WORKFLOW_ID.match(workflow_id):
            raise errors.ValidationError(
                "workflow_id", "must be 1-80 characters of letters, digits, '.', '_', ':' and '-'"
            )
        if "caller" in data:
            raise errors.ValidationError("input.caller", "is set by the orchestrator from the caller's token")
        params = parse_input(kind.input, data)
        authorize_start(kind.name, params, caller)
        kind.validate(params)
        if "caller" in {f.name for f in dataclasses.fields(params)}:
            params = dataclasses.replace(params, caller=caller)
        workflow_id = workflow_id or f"{kind.name}-{uuid.uuid4().hex[:12]}"
        memo: dict[str, Any] = {MEMO_CALLER: caller.name, MEMO_TEAM: caller.team, **kind.memo(params)}
        if self._grant_key is not None:
            payloads = await self._client.data_converter.encode([params])
            memo[MEMO_GRANT] = sign(self._grant_key, kind.name, workflow_id, payloads, caller)
        try:
            handle: WorkflowHandle[Any, Any] = await self._client.start_workflow(
                kind.name,
                params,
                id=workflow_id,
                task_queue=kind.queue(self._task_queue),
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                rpc_timeout=self._rpc_timeout,
                memo=memo,
            )
        except WorkflowAlreadyStartedError:  # closed under this id: report it rather than run it again
            handle = self._client.get_workflow_handle(workflow_id)
        run_id = handle.result_run_id or handle.run_id
        if not run_id or not caller.is_admin:
            description = await self._describe(handle, caller)
            if description.workflow_type != kind.name:
                raise errors.AlreadyExistsError(
                    f"workflow {workflow_id!r} exists with type {description.workflow_type!r}"
                )
            run_id = run_id or description.run_id or ""
        log.info(
            "workflow.started",
            workflow_type=kind.name,
            workflow_id=workflow_id,
            run_id=run_id,
            caller=caller.name,
        )
        return workflow_id, run_id

    async def _describe(self, handle: WorkflowHandle[Any, Any], caller: Caller = ADMIN) -> Any:
        """The workflow's description; a team caller sees only its team's workflows (another
        team's answers NOT_FOUND, as a missing one does)."""
        try:
            description = await handle.describe(rpc_timeout=self._rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise errors.NotFoundError(f"workflow {handle.id!r} not found") from None
            if exc.status == RPCStatusCode.INVALID_ARGUMENT:  # an id Temporal cannot take
                raise errors.ValidationError("workflow_id", exc.message) from None
            raise temporal_unavailable(exc) from exc
        if not caller.is_admin:
            try:
                team = await description.memo_value(MEMO_TEAM, default="")
            except Exception:  # noqa: BLE001 - an undecodable memo is nobody's
                team = ""
            if team != caller.team:
                raise errors.NotFoundError(f"workflow {handle.id!r} not found")
        return description

    async def get_workflow(self, workflow_id: str, run_id: str = "", caller: Caller = ADMIN) -> WorkflowView:
        """Status of a run (the latest when ``run_id`` is empty), its result, error or progress."""
        if not workflow_id:
            raise errors.ValidationError("workflow_id", "must not be empty")
        if run_id:
            try:
                uuid.UUID(run_id)
            except ValueError:
                raise errors.ValidationError("run_id", "must be empty or a run id (a UUID)") from None
        d = await self._describe(self._client.get_workflow_handle(workflow_id, run_id=run_id or None), caller)
        handle = self._client.get_workflow_handle(workflow_id, run_id=d.run_id)
        view = WorkflowView(
            workflow_id=workflow_id,
            run_id=d.run_id or "",
            workflow_type=d.workflow_type or "",
            status=d.status or WorkflowExecutionStatus.RUNNING,
            started_at=d.start_time,
            closed_at=d.close_time,
        )
        if view.status == WorkflowExecutionStatus.RUNNING:
            return dataclasses.replace(view, progress=await self._progress(handle))
        if view.status == WorkflowExecutionStatus.CONTINUED_AS_NEW:
            return view
        try:
            result = await handle.result(follow_runs=False, rpc_timeout=self._rpc_timeout)
        except WorkflowFailureError as exc:
            return dataclasses.replace(view, error=failure_message(exc))
        except RPCError as exc:
            raise temporal_unavailable(exc) from exc
        return dataclasses.replace(view, result=to_json(result))

    async def _progress(self, handle: WorkflowHandle[Any, Any]) -> dict[str, Any] | None:
        # Answered by a worker; while none is polling (e.g. it is restarting) progress is absent.
        try:
            progress = await handle.query(PROGRESS_QUERY, rpc_timeout=self._query_timeout)
        except Exception as exc:  # noqa: BLE001 - progress is best effort, status is not
            log.debug("workflow.progress_unavailable", workflow_id=handle.id, error=repr(exc))
            return None
        return progress if isinstance(progress, dict) else None

    async def cancel_workflow(self, workflow_id: str, reason: str = "", caller: Caller = ADMIN) -> None:
        """Request cancellation. Idempotent for a workflow already cancelled or being cancelled;
        a workflow that closed otherwise cannot be cancelled (``FAILED_PRECONDITION``)."""
        if not workflow_id:
            raise errors.ValidationError("workflow_id", "must not be empty")
        handle = self._client.get_workflow_handle(workflow_id)
        d = await self._describe(handle, caller)
        if d.status == WorkflowExecutionStatus.CANCELED:
            return
        if d.status != WorkflowExecutionStatus.RUNNING:
            raise errors.ConflictError(
                f"workflow {workflow_id!r} is already {d.status.name if d.status else 'closed'}"
            )
        await handle.cancel(reason=reason, rpc_timeout=self._rpc_timeout)
        log.info("workflow.cancel_requested", workflow_id=workflow_id, reason=reason)


#: Temporal's answers that say it did not get to the request (its RPC timed out, as it does on a
#: loaded machine, or it is unreachable): the caller may send the same request again.
TRANSIENT_TEMPORAL = frozenset(
    {
        RPCStatusCode.CANCELLED,  # the SDK's "Timeout expired"
        RPCStatusCode.DEADLINE_EXCEEDED,
        RPCStatusCode.UNAVAILABLE,
        RPCStatusCode.RESOURCE_EXHAUSTED,
    }
)


def temporal_unavailable(exc: RPCError) -> Exception:
    """What to raise for Temporal's ``exc``: ``UnavailableError`` (``UNAVAILABLE``, retry) when
    it is transient, else ``exc`` itself (``INTERNAL``)."""
    if exc.status in TRANSIENT_TEMPORAL:
        return errors.UnavailableError(f"Temporal did not answer ({exc.message}); retry", retry_after_s=2.0)
    return exc


async def connect_temporal(
    target: str, namespace: str, *, timeout_s: float, tls: TLSConfig | None = None
) -> Client:
    """Connect to Temporal, retrying with jittered backoff for up to ``timeout_s`` (it may be
    starting); with ``tls``, over mutual TLS."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    backoff = Backoff(0.2, 5.0)
    while True:
        try:
            return await Client.connect(target, namespace=namespace, tls=tls or False)
        except RuntimeError as exc:  # the SDK's connection failure
            delay = backoff.next_delay()
            if loop.time() + delay > deadline:
                raise RuntimeError(f"Temporal at {target} unreachable for {timeout_s:g}s: {exc}") from exc
            log.warning("temporal.connect_failed", target=target, error=str(exc), retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)


def build_worker(
    client: Client,
    task_queue: str,
    activities: SchedulerActivities,
    eval_activities: EvalActivities | None = None,
    workflows: Sequence[type] = WORKFLOWS,
    extra_activities: Sequence[Callable[..., Any]] = (),
    canary: CanaryActivities | None = None,
    *,
    guard: Interceptor | None,
    promotions: PromotionActivities | None = None,
) -> Worker:
    """The Temporal worker of this process: every workflow of :data:`KINDS` and their activities
    (``canary`` None: a guarded canary watches no gateway, so it sees no traffic; ``promotions``
    None: promotions roll no replicas). ``guard``: the
    :class:`~forge_orchestrator.grant.StartGuard` the service runs with (None only in tests that
    start workflows on Temporal directly)."""
    methods: list[Callable[..., Any]] = [activities.ensure_team, activities.submit_job, activities.cancel_job]
    methods += extra_activities
    if eval_activities is not None:
        methods += [
            eval_activities.register_model,
            eval_activities.current_model,
            eval_activities.model_uri,
            eval_activities.run_suite,
            eval_activities.get_run,
            eval_activities.compare_runs,
            eval_activities.promote_model,
            eval_activities.rollout_state,
            eval_activities.decide_rollout,
            *(canary or CanaryActivities()).methods(),
            *(promotions or PromotionActivities()).methods(),
        ]
    return Worker(
        client,
        task_queue=task_queue,
        workflows=list(workflows),
        activities=methods,
        interceptors=[guard] if guard is not None else [],
    )
