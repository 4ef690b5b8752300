"""Activities that call the eval service over gRPC (its registry, runs and rollout decisions):
eval-and-promote, the deployments' promotion steps, CPT and RLHF use them, so they live beside
:mod:`forge_orchestrator.activities` (the scheduler's) rather than in one use case's package.

Each returns plain dataclasses (Temporal serialises them as JSON). Failures follow
:func:`forge_orchestrator.activities.failed`: permanent gRPC statuses are non-retryable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit.grpckit import LazyChannel
from forge_kit.modelref import ModelRef
from forge_orchestrator.activities import failed


@dataclass
class ModelId:
    """A registry entry's identity (a :class:`~forge_kit.modelref.ModelRef` as Temporal's JSON
    carries it)."""

    name: str
    version: str

    @classmethod
    def of(cls, model: ModelRef) -> ModelId:
        return cls(model.name, model.version)

    def model(self) -> ModelRef:
        return ModelRef(self.name, self.version)

    def ref(self) -> common_pb2.ModelRef:
        model = self.model()
        return common_pb2.ModelRef(name=model.name, version=model.version)

    def __str__(self) -> str:
        return str(self.model())


@dataclass
class RegisterInput:
    model: ModelId
    uri: str
    labels: dict[str, str] = field(default_factory=dict)
    training_run_id: str = ""
    recipe_hash: str = ""
    data_hash: str = ""
    parent: str = ""
    """The registered model it was trained from, ``name:version``; empty if none."""


@dataclass
class RunInput:
    """One suite run; ``endpoint`` empty means eval's configured default (the gateway), unless
    ``serve_model``: eval then starts a model server from the model's registered checkpoint for
    the run. ``tier`` is ``full`` or ``smoke``."""

    model: ModelId
    suite: str
    limit: int
    seed: int
    endpoint: str = ""
    tier: str = "full"
    serve_model: bool = False


@dataclass
class RunState:
    run_id: str
    status: str
    """``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``CANCELLED``."""
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    passed_gate: bool = False
    intervals: dict[str, list[float]] = field(default_factory=dict)
    """Per metric, its 95% interval ``[low, high]``."""
    tier: str = "full"
    report_path: str = ""

    @property
    def finished(self) -> bool:
        return self.status in ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class Comparison:
    verdict: str
    """``BETTER``, ``WORSE``, ``NO_DIFFERENCE`` or ``INCOMPARABLE``."""
    deltas: dict[str, float] = field(default_factory=dict)
    p_values: dict[str, float] = field(default_factory=dict)
    report_path: str = ""
    intervals: dict[str, list[float]] = field(default_factory=dict)
    """Per metric, the interval ``[low, high]`` of candidate - baseline (paired bootstrap)."""


@dataclass
class PromoteInput:
    """A promotion through eval's release gate (a workflow never forces one)."""

    model: ModelId
    stage: str
    traffic_percent: int
    reason: str


@dataclass
class RolloutState:
    """A canary's registry state: its stage now and whether an operator paused its analysis."""

    stage: str
    paused: bool = False
    actor: str = ""
    """Who moved it out of canary, when it left (an operator's override)."""
    reason: str = ""


@dataclass
class DecisionInput:
    model: ModelId
    decision: str
    reason: str
    evidence: str = ""


class EvalActivities:
    """Eval calls for workflows; the channel opens on first use, in the worker's event loop."""

    def __init__(self, target: str, token: str, *, rpc_timeout_s: float = 15.0) -> None:
        self._rpc_timeout_s = rpc_timeout_s
        self._channel = LazyChannel(target, token)

    def _stub(self) -> eval_pb2_grpc.EvalServiceAsyncStub:
        return eval_pb2_grpc.EvalServiceStub(self._channel.get())

    async def close(self) -> None:
        await self._channel.close()

    @activity.defn(name="eval_register_model")
    async def register_model(self, params: RegisterInput) -> bool:
        """Register the candidate; False when it was already registered (a retried workflow)."""
        lineage = eval_pb2.Lineage(
            training_run_id=params.training_run_id, recipe_hash=params.recipe_hash, data_hash=params.data_hash
        )
        try:
            parent = ModelRef.parse_optional(params.parent)
        except ValueError as exc:
            raise ApplicationError(f"lineage parent: {exc}", non_retryable=True) from None
        if parent is not None:
            lineage.parent.CopyFrom(ModelId.of(parent).ref())
        request = eval_pb2.RegisterModelRequest(
            ref=params.model.ref(), uri=params.uri, labels=params.labels, lineage=lineage
        )
        try:
            await self._stub().RegisterModel(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return False
            raise failed("RegisterModel", exc) from exc
        return True

    @activity.defn(name="eval_current_model")
    async def current_model(self, stage: str) -> ModelId | None:
        """The model holding ``stage`` now, or None."""
        request = eval_pb2.ListModelsRequest(stage=stage, page=common_pb2.PageRequest(page_size=1))
        try:
            reply = await self._stub().ListModels(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("ListModels", exc) from exc
        if not reply.models:
            return None
        ref = reply.models[0].ref
        return ModelId(name=ref.name, version=ref.version)

    @activity.defn(name="eval_model_uri")
    async def model_uri(self, model: ModelId) -> str:
        """Where the registered ``model``'s checkpoint is; empty when it is not registered."""
        token = ""
        while True:
            request = eval_pb2.ListModelsRequest(
                name=model.name, page=common_pb2.PageRequest(page_size=200, page_token=token)
            )
            try:
                reply = await self._stub().ListModels(request, timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise failed("ListModels", exc) from exc
            for registered in reply.models:
                if registered.ref.version == model.version:
                    return str(registered.uri)
            token = reply.page.next_page_token
            if not token:
                return ""

    @activity.defn(name="eval_run_suite")
    async def run_suite(self, params: RunInput) -> str:
        """Queue a suite run; returns its id."""
        request = eval_pb2.RunSuiteRequest(
            suite=params.suite,
            model=params.model.ref(),
            endpoint=params.endpoint,
            limit=params.limit,
            seed=params.seed,
            tier=params.tier,
            serve_model=params.serve_model,
        )
        try:
            reply = await self._stub().RunSuite(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("RunSuite", exc) from exc
        return str(reply.run_id)

    @activity.defn(name="eval_get_run")
    async def get_run(self, run_id: str) -> RunState:
        try:
            reply = await self._stub().GetRun(
                eval_pb2.GetRunRequest(run_id=run_id), timeout=self._rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise failed("GetRun", exc) from exc
        run = reply.run
        return RunState(
            run_id=run.run_id,
            status=eval_pb2.RunStatus.Name(run.status).removeprefix("RUN_STATUS_"),
            error=run.error,
            metrics={m.name: m.value for m in run.metrics},
            passed_gate=run.passed_gate,
            intervals={m.name: [m.ci_low, m.ci_high] for m in run.metrics},
            tier=run.tier,
            report_path=run.report_path,
        )

    @activity.defn(name="eval_compare_runs")
    async def compare_runs(self, baseline_run_id: str, candidate_run_id: str) -> Comparison:
        request = eval_pb2.CompareRunsRequest(
            baseline_run_id=baseline_run_id, candidate_run_id=candidate_run_id
        )
        try:
            reply = await self._stub().CompareRuns(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("CompareRuns", exc) from exc
        return Comparison(
            verdict=eval_pb2.Verdict.Name(reply.verdict).removeprefix("VERDICT_"),
            deltas={d.name: d.delta for d in reply.deltas},
            p_values={d.name: d.p_value for d in reply.deltas},
            report_path=reply.report_path,
            intervals={d.name: [d.ci_low, d.ci_high] for d in reply.deltas},
        )

    @activity.defn(name="eval_promote_model")
    async def promote_model(self, params: PromoteInput) -> str:
        """Promote; returns the previous holder of the stage as ``name:version`` (empty if none)."""
        request = eval_pb2.PromoteModelRequest(
            ref=params.model.ref(),
            stage=params.stage,
            traffic_percent=params.traffic_percent,
            reason=params.reason,
        )
        try:
            reply = await self._stub().PromoteModel(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("PromoteModel", exc) from exc
        previous = reply.previous
        return str(ModelRef.of(previous)) if previous.name else ""

    @activity.defn(name="eval_rollout_state")
    async def rollout_state(self, model: ModelId) -> RolloutState:
        """The model's stage and, from its newest audit events, whether it is paused and who
        took it out of canary."""
        request = eval_pb2.ListStageEventsRequest(
            model_name=model.name, model_version=model.version, page=common_pb2.PageRequest(page_size=50)
        )
        try:
            reply = await self._stub().ListStageEvents(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("ListStageEvents", exc) from exc
        events = list(reply.events)
        if not events:
            return RolloutState(stage="")
        newest = events[0]
        toggles = [e.action for e in events if e.action in ("pause", "resume")]
        return RolloutState(
            stage=newest.to_stage,
            paused=bool(toggles) and toggles[0] == "pause",
            actor=newest.actor,
            reason=newest.reason,
        )

    @activity.defn(name="eval_decide_rollout")
    async def decide_rollout(self, params: DecisionInput) -> str:
        """Record a canary decision with its evidence (promote and rollback move the model)."""
        request = eval_pb2.DecideRolloutRequest(
            ref=params.model.ref(), decision=params.decision, reason=params.reason, evidence=params.evidence
        )
        try:
            reply = await self._stub().DecideRollout(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("DecideRollout", exc) from exc
        return str(reply.event.event_id)
