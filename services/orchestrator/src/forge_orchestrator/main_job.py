"""The orchestrator's steps of the platform main job (entry-point group ``forge.main_job``).

``forge up`` calls them with its main-job context once every service is healthy:

- :func:`smoke` (order 10): the ``smoke`` workflow, through every layer;
- :func:`rlhf` (order 80, after ``train``, ``preferences``, ``eval`` and ``chat``): one small
  RLHF round end to end on the preferences the feedback step posted, from the train step's
  checkpoint (see :func:`rlhf`).

The steps never import the CLI or another service: they need ``ctx.endpoint(name)`` with
``grpc_target`` and ``token``, ``ctx.results`` and ``ctx.object_store_url``, described by the
local protocols below.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from forge.orchestrator.v1 import orchestrator_pb2
from google.protobuf import json_format

from forge_orchestrator.client import OrchestratorClient, status_name

#: How long the smoke workflow may take before the step gives up waiting on it.
SMOKE_WAIT_S = 90.0


class Endpoint(Protocol):
    @property
    def grpc_target(self) -> str: ...

    @property
    def token(self) -> str: ...


class MainJobContext(Protocol):
    """The part of ``forge_cli.mainjob.MainJobContext`` these steps use."""

    @property
    def results(self) -> Mapping[str, Mapping[str, Any]]: ...

    @property
    def object_store_url(self) -> str: ...

    def endpoint(self, name: str) -> Endpoint: ...


async def smoke(ctx: MainJobContext) -> dict[str, object]:
    """Start the ``smoke`` workflow on the orchestrator and wait for it: a gRPC call into the
    orchestrator, a Temporal workflow calling the scheduler, and the scheduler's job events
    coming back through Kafka to the orchestrator's consumer."""
    endpoint = ctx.endpoint("orchestrator")
    async with OrchestratorClient(endpoint.grpc_target, endpoint.token) as client:
        workflow_id = await client.start("smoke", {"timeout_s": SMOKE_WAIT_S / 2})
        reply = await client.wait(workflow_id, timeout_s=SMOKE_WAIT_S)
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        ended = status_name(reply.status)
        raise RuntimeError(f"smoke workflow {workflow_id} ended {ended}: {reply.error or 'no error given'}")
    result = json_format.MessageToDict(reply.result)
    return {
        "ok": True,
        "workflow_id": workflow_id,
        "job_id": result["job_id"],
        "states_seen": list(result["states_seen"]),
        "elapsed_s": result["elapsed_s"],
    }


smoke.order = 10  # type: ignore[attr-defined]
smoke.timeout_s = SMOKE_WAIT_S + 30  # type: ignore[attr-defined]


# --- one small RLHF round ---------------------------------------------------------------------

#: How long the round may take: reward-model and DPO jobs (which wait for the agents' polls), then
#: eval-and-promote, which starts a model server and scores ``tinyshakespeare_ppl`` (see
#: ``forge_eval.main_job``). The margin is for a small machine shared with other work.
RLHF_WAIT_S = 540.0
#: The train step's team, whose quota covers the two simulated GPUs of ``forge up``'s agents.
TEAM = "main-job"
GPU_TYPE = "SIM"
#: The smallest sizes that still do every step for real, on the feedback step's full-stop-rule
#: pairs (it tops accepted pairs up to 144): the reward model passes its gate (95 % interval above
#: chance on ~50 held-out pairs), DPO moves the policy, the drift check scores it.
RLHF_SIZES: dict[str, object] = {
    "min_new_pairs": 100,
    "heldout_fraction": 0.35,
    "reward_overrides": [
        "max_steps=40",
        "optim.lr=1e-3",
        "optim.warmup_steps=2",
        "eval_batches=2",
        "eval_interval=100",
        "checkpoint.interval_steps=0",
    ],
    "dpo_overrides": [
        "max_steps=10",
        "optim.lr=1e-3",
        "optim.warmup_steps=2",
        "eval_batches=2",
        "eval_interval=100",
        "checkpoint.interval_steps=0",
    ],
    "check_max_prompts": 6,
    "check_max_new_tokens": 12,
    "promote_tier": "smoke",
    "promote_limit": 20,
}


class RlhfStepError(RuntimeError):
    """The RLHF step cannot run or report its round; the message says why."""


def rlhf_input(ctx: MainJobContext) -> dict[str, object]:
    """The ``rlhf`` workflow's input: the train step's checkpoint as the reference policy, jobs on
    ``forge up``'s simulated GPUs in this environment, results under the object store."""
    train = ctx.results.get("train")
    uri = train.get("checkpoint_uri") if train is not None else None
    if not isinstance(uri, str) or not uri:
        done = ", ".join(ctx.results) or "none"
        raise RlhfStepError(
            "the rlhf step starts from the train step's checkpoint, but ctx.results['train'] has no "
            f"checkpoint_uri (steps done: {done}); a step named 'train' must run first"
        )
    return {
        "policy_uri": uri,
        "work_uri": f"{ctx.object_store_url.rstrip('/')}/rlhf",
        "team": TEAM,
        "gpu_type": GPU_TYPE,
        "python": sys.executable,  # the agents run on this machine, in this environment
        "poll_s": 2.0,
        "max_poll_s": 10.0,
        "buffer_timeout_s": 60.0,
        "job_timeout_s": RLHF_WAIT_S,
        "checkpoint_wait_s": 60.0,
        "max_rounds": 1,
        **RLHF_SIZES,
    }


def _num(value: object) -> float | None:
    return round(float(value), 4) if isinstance(value, int | float) else None


def round_report(result: Mapping[str, Any]) -> dict[str, object]:
    """The figures of the round in an ``rlhf`` result (JSON, as GetWorkflow returns it)."""
    rounds = result.get("rounds") or []
    if not rounds:
        raise RlhfStepError(f"the rlhf workflow ran no round ({result.get('ended') or 'no reason given'})")
    r: Mapping[str, Any] = rounds[-1]
    drift = r.get("drift") or []
    newest: Mapping[str, Any] = drift[-1] if drift else {}
    status, reason, decision = str(r.get("status", "")), str(r.get("reason", "")), str(r.get("decision", ""))
    outcome = {
        "rejected": f"refused: {reason}",
        "stopped": f"stopped by the drift check: {reason}",
        "completed": f"eval-and-promote: {decision}" if decision else "completed (not handed over)",
    }.get(status, f"{status}: {reason}")
    if status == "completed" and reason:  # why it was blocked, or the guarded canary's decision
        outcome += f" ({reason})"
    return {
        "outcome": outcome,
        "promoted": decision == "promoted",
        "round_status": status,
        "snapshot": r.get("snapshot_id", ""),
        "pairs": {"train": int(r.get("train_pairs", 0)), "heldout": int(r.get("test_pairs", 0))},
        "excluded_raters": dict(r.get("excluded_raters") or {}),
        "reward_model": r.get("reward_model", ""),
        "rm_accuracy": _num(r.get("rm_accuracy")),
        "rm_ci95": [_num(r.get("rm_ci95_low")), _num(r.get("rm_ci95_high"))],
        "rm_n": int(r.get("rm_n", 0)),
        "kl": _num(newest.get("kl")),
        "sqrt_kl": _num(newest.get("sqrt_kl")),
        "proxy_reward": _num(newest.get("proxy_reward")),
        "reference_proxy_reward": _num(drift[0].get("proxy_reward")) if drift else None,
        "heldout_agreement": _num(newest.get("heldout_agreement")),
        "policy_uri": r.get("policy_uri", ""),
        "eval_workflow_id": r.get("eval_workflow_id", ""),
    }


async def rlhf(ctx: MainJobContext) -> dict[str, object]:
    """One small RLHF round, end to end, through the orchestrator's API:

    1. build the input from the train step's checkpoint (the reference policy);
    2. start the ``rlhf`` workflow; it snapshots the accepted pairs the feedback step posted,
       trains the reward model as a job on the trainer agents, evaluates it on the held-out
       pairs and registers it, runs DPO and the drift check as jobs, and hands the policy to
       eval-and-promote;
    3. wait for it (cancelled when it overruns);
    4. report the round: reward-model accuracy with its interval, KL to the reference, the
       drift figures, and whether the policy was promoted. A refused reward model or a drift
       stop is a genuine outcome and is reported as such; a failed workflow fails the step.
    """
    # 1.
    data = rlhf_input(ctx)
    endpoint = ctx.endpoint("orchestrator")
    async with OrchestratorClient(endpoint.grpc_target, endpoint.token) as client:
        # 2.
        workflow_id = await client.start("rlhf", data, workflow_id=f"main-job-rlhf-{uuid.uuid4().hex[:8]}")
        # 3.
        try:
            reply = await client.wait(workflow_id, timeout_s=RLHF_WAIT_S, poll_s=2.0)
        except TimeoutError:
            last = await client.get(workflow_id)
            step = last.progress.fields["step"].string_value if last.HasField("progress") else "unknown"
            await client.cancel(workflow_id, "main job: the round overran its time")
            raise RlhfStepError(
                f"rlhf workflow {workflow_id} still running after {RLHF_WAIT_S:g}s (at: {step}); cancelled"
            ) from None
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        raise RlhfStepError(
            f"rlhf workflow {workflow_id} ended {status_name(reply.status)}: {reply.error or 'no error given'}"
        )
    # 4.
    elapsed = (reply.closed_at.ToDatetime() - reply.started_at.ToDatetime()).total_seconds()
    return {
        "ok": True,
        "workflow_id": workflow_id,
        **round_report(json_format.MessageToDict(reply.result)),
        "elapsed_s": round(elapsed, 1),
        "page": "/ui/admin/rlhf on the preference-feedback service",
    }


rlhf.order = 80  # type: ignore[attr-defined]
rlhf.timeout_s = RLHF_WAIT_S + 60  # type: ignore[attr-defined]
