"""Eval's step of the platform main job (entry-point group ``forge.main_job``, order 60).

The training step (order 40) leaves ``ctx.results["train"] = {"checkpoint_id", "checkpoint_uri",
"run_id"}``; publishing that checkpoint emitted ``CheckpointPublished``, which the orchestrator
turned into an eval-and-promote workflow. This step waits for that workflow and returns its
decision, the candidate's scores with their intervals, and the report's path:

1. check the train step's result;
2. find the checkpoint in eval's registry (the workflow registers it first thing, with its own id
   as the label ``workflow_id``) by its uri among the models named after the run;
3. poll the workflow through the orchestrator's GetWorkflow until it closes; meanwhile, when the
   platform has a gateway, :func:`forge_experiments.canary_traffic.serve_and_drive` waits until
   the gateway answers the candidate once it reaches ``canary`` (from its deployment's replicas;
   loaded into the platform's model server only where promotions deploy nothing) and chats with
   ``forge-chat`` through the gateway with distinct users, so the guarded canary decides on
   traffic;
4. return what it decided, with the canary's evidence (requests per arm, p-values) and the
   traffic sent; a workflow that failed fails the step with its error.

The step never imports the CLI or another service: ``ctx`` is the kit's
:class:`~forge_kit.mainjob.MainJobContext`, and the orchestrator is reached through the kit's
:class:`~forge_kit.orchestrator_client.OrchestratorClient`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from forge.orchestrator.v1 import orchestrator_pb2
from google.protobuf import json_format

from forge_experiments.canary_traffic import canary_summary, main_job_traffic
from forge_kit.grpckit import make_channel
from forge_kit.mainjob import MainJobContext
from forge_kit.modelref import ModelRef
from forge_kit.orchestrator_client import OrchestratorClient, status_name

#: How long the step waits for the workflow: the release runs (``tinyshakespeare_ppl``, smoke
#: tier: 20 documents in the trained model's 512-token windows) plus, where promotions roll
#: replicas (``forge up``), the trained model's vLLM replica starting before they score it
#: (420 s, the serve step's allowance: 60-75 s on an idle 2-core machine, up to 345 s measured
#: on a loaded one); a second ``forge up`` also re-scores production, from the response cache.
#: The margin is for a small machine shared with other work.
STEP_TIMEOUT_S = 660.0
POLL_S = 0.5
#: The keys the training step's result must have.
TRAIN_KEYS = ("checkpoint_id", "checkpoint_uri", "run_id")
#: The gateway's production alias the canary splits.
PUBLIC_MODEL = "forge-chat"


class StepError(RuntimeError):
    """The step cannot report a decision; the message says why."""


def train_result(ctx: MainJobContext) -> tuple[str, str, str]:
    """(checkpoint id, checkpoint uri, run id) from the train step, or a clear error."""
    train = ctx.results.get("train")
    if train is None:
        done = ", ".join(ctx.results) or "none"
        raise StepError(
            "the eval step evaluates the checkpoint of the train step, but ctx.results has no "
            f"'train' entry (steps done: {done}); a step named 'train' with an order below 60 must run first"
        )
    values = []
    for key in TRAIN_KEYS:
        value = train.get(key)
        if not isinstance(value, str) or not value:
            raise StepError(f"ctx.results['train'][{key!r}] must be a non-empty string, got {value!r}")
        values.append(value)
    return values[0], values[1], values[2]


def _same_checkpoint(a: str, b: str) -> bool:
    def norm(uri: str) -> str:
        path = uri.removeprefix("file://")
        return str(Path(path).resolve()) if path.startswith("/") else uri

    return norm(a) == norm(b)


async def _find_model(
    stub: eval_pb2_grpc.EvalServiceAsyncStub, run_id: str, uri: str
) -> eval_pb2.RegisteredModel | None:
    """The registered model whose uri is the checkpoint's: among those named after the run
    first (the orchestrator names checkpoints by run), else among the newest of any name."""
    for name in (run_id, ""):
        reply = await stub.ListModels(
            eval_pb2.ListModelsRequest(name=name, page=common_pb2.PageRequest(page_size=200)), timeout=10
        )
        for model in reply.models:
            if _same_checkpoint(model.uri, uri):
                return model
    return None


async def evaluate_checkpoint(ctx: MainJobContext, *, timeout_s: float = STEP_TIMEOUT_S) -> dict[str, object]:
    """Wait for the eval-and-promote workflow of the train step's checkpoint; its decision."""
    # 1. The train step's checkpoint.
    checkpoint_id, uri, run_id = train_result(ctx)
    deadline = time.monotonic() + timeout_s
    eval_endpoint, orchestrator = ctx.endpoint("eval"), ctx.endpoint("orchestrator")
    # 2. Its registry entry, written by the workflow's first activity.
    async with make_channel(eval_endpoint.grpc_target, token=eval_endpoint.token) as channel:
        registry = eval_pb2_grpc.EvalServiceStub(channel)
        while (model := await _find_model(registry, run_id, uri)) is None:
            if time.monotonic() > deadline:
                raise StepError(
                    f"checkpoint {checkpoint_id} ({uri}) never reached eval's registry in {timeout_s:g}s: "
                    "no eval-and-promote workflow picked up its CheckpointPublished event"
                )
            await asyncio.sleep(POLL_S)
    ref = str(ModelRef.of(model.ref))
    workflow_id = model.labels.get("workflow_id") or f"eval-{model.ref.name}-{model.ref.version}"[:80]
    # 3. The workflow, until it closes; traffic for its canary meanwhile.
    stop = asyncio.Event()
    traffic = main_job_traffic(ctx, PUBLIC_MODEL, stop)
    try:
        async with OrchestratorClient(orchestrator.grpc_target, orchestrator.token) as workflows:
            # NOT_FOUND: not visible yet; UNAVAILABLE, DEADLINE_EXCEEDED: not answered this time.
            reply = await workflows.wait(
                workflow_id,
                timeout_s=max(0.0, deadline - time.monotonic()),
                poll_s=POLL_S,
                until_visible=True,
            )
    except TimeoutError:
        raise StepError(
            f"eval-and-promote workflow {workflow_id} of {ref} still running after {timeout_s:g}s"
        ) from None
    finally:
        stop.set()
    sent = await traffic if traffic is not None else None
    # 4. Its decision.
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        raise StepError(
            f"eval-and-promote workflow {workflow_id} of {ref} ended {status_name(reply.status)}: "
            f"{reply.error or 'no error given'}"
        )
    result = json_format.MessageToDict(reply.result)
    canary = result.get("canary") or {}
    return {
        "ok": True,
        "checkpoint_id": checkpoint_id,
        "model": ref,
        "workflow_id": workflow_id,
        "decision": result.get("decision", ""),
        "verdict": result.get("verdict") or "no production model to compare with",
        "baseline": result.get("baseline", ""),
        "promoted_to": list(result.get("promoted_to", [])),
        "blocked_reason": result.get("blocked_reason", ""),
        "canary": _canary(canary),
        "canary_evidence": canary_summary(canary),
        "canary_traffic": sent.as_dict() if sent is not None else "no gateway in this platform",
        "tier": result.get("tier", ""),
        "scores": dict(result.get("metrics", {})),
        "intervals": dict(result.get("intervals", {})),
        "report": result.get("report_path", ""),
    }


def _canary(canary: dict[str, object]) -> str:
    """The guarded canary's decision in a line; empty when there was none (the first model)."""
    if not canary:
        return ""
    return (
        f"{canary.get('decision')} by {canary.get('decided_by')} after {canary.get('decided_after_s')}s, "
        f"{canary.get('canary_requests', 0)} canary requests ({canary.get('policy')}): {canary.get('reason')}"
    )


async def step(ctx: MainJobContext) -> dict[str, object]:
    """The trained checkpoint is evaluated, compared with production and promoted (or blocked)."""
    return await evaluate_checkpoint(ctx)


step.order = 60  # type: ignore[attr-defined]
step.timeout_s = STEP_TIMEOUT_S + 5  # type: ignore[attr-defined]
