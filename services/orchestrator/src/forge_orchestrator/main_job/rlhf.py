"""The ``rlhf`` step of the platform main job (order 80, after ``train``, ``preferences``,
``eval`` and ``chat``): one small online RLHF round end to end: the train step's checkpoint, as the
chat step serves it through the gateway, is sampled on the prompt pool, the rule-based simulated
raters (:mod:`.raters`) answer the comparisons made from its samples, and the round trains on them
(see :func:`rlhf`).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from forge.orchestrator.v1 import orchestrator_pb2
from google.protobuf import json_format

from forge_experiments.canary_traffic import TrafficReport, canary_summary, main_job_traffic
from forge_kit.mainjob import MainJobContext
from forge_kit.orchestrator_client import RETRIED_WHILE_WAITING, OrchestratorClient, status_name
from forge_orchestrator.main_job.raters import RaterPool

#: How long the round may take: reward-model and DPO jobs (which wait for the agents' polls), then
#: eval-and-promote, which, where promotions roll replicas (``forge up``), deploys the policy on
#: vLLM (allowed 420 s to start, as the serve step's replica is) before it scores
#: ``tinyshakespeare_ppl`` through the gateway (see ``forge_eval.main_job``). The margin is for a
#: small machine shared with other work.
RLHF_WAIT_S = 1140.0
#: The gateway's production alias, which the canary splits.
PUBLIC_MODEL = "forge-chat"
#: The train step's team, whose quota covers the two simulated GPUs of ``forge up``'s agents.
TEAM = "main-job"
GPU_TYPE = "SIM"
#: The smallest sizes that still do every step for real: 16 HH-RLHF prompts short enough for the
#: small policy, two samples each (temperatures 0.7 and 1.3) of 24 tokens, answered by the rater
#: pool (overlap 3); the reward model trains on those and the feedback step's full-stop-rule pairs
#: (95 % interval above chance on the held-out share), DPO moves the policy with the monitor every
#: 2 steps, the drift check scores it.
RLHF_SIZES: dict[str, object] = {
    "min_new_pairs": 100,
    "prompt_dataset": "preferences/hh-rlhf/helpful-base/test.jsonl.gz",
    "dataset_prompts": 16,
    "production_prompts": 8,
    "max_prompt_chars": 400,
    "sample_max_tokens": 24,
    "min_policy_pairs": 24,
    "min_raters": 3,
    "monitor_interval": 2,
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
    done = ", ".join(ctx.results) or "none"
    if not isinstance(uri, str) or not uri:
        raise RlhfStepError(
            "the rlhf step starts from the train step's checkpoint, but ctx.results['train'] has no "
            f"checkpoint_uri (steps done: {done}); a step named 'train' must run first"
        )
    chat = ctx.results.get("chat")
    served = chat.get("trained_model") if chat is not None else None
    if not isinstance(served, str) or not served:
        raise RlhfStepError(
            "the rlhf step samples the policy as the chat step serves it through the gateway, but "
            f"ctx.results['chat'] has no trained_model (steps done: {done}); a step named 'chat' must run first"
        )
    return {
        "policy_uri": uri,
        "sample_model": served,
        # Pairs the gateway mirrored to a shadow of the product alias join the raters' queue.
        "shadow_alias": PUBLIC_MODEL,
        "work_uri": f"{ctx.object_store_url.rstrip('/')}/rlhf",
        "team": TEAM,
        "gpu_type": GPU_TYPE,
        "python": sys.executable,  # the agents run on this machine, in this environment
        "poll_s": 2.0,
        "max_poll_s": 10.0,
        "buffer_timeout_s": 240.0,
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
        "stalled": f"stalled: {reason}",
        "stopped": f"stopped by the drift check: {reason}",
        "completed": f"eval-and-promote: {decision}" if decision else "completed (not handed over)",
    }.get(status, f"{status}: {reason}")
    if status == "completed" and reason:  # why it was blocked, or the guarded canary's decision
        outcome += f" ({reason})"
    monitor = r.get("training_monitor") or []
    return {
        "outcome": outcome,
        "promoted": decision == "promoted",
        "round_status": status,
        "policy_samples": {
            "batch": r.get("batch", ""),
            "prompts": dict(r.get("prompts") or {}),
            "comparisons_queued": int(r.get("queued", 0)),
            "accepted_preferences": int(r.get("new_pairs", 0)),
        },
        "dpo_monitor": {
            "checks": len(monitor),
            "last": {k: _num(v) for k, v in monitor[-1].items()} if monitor else None,
            "early_stop": r.get("early_stop", ""),
        },
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
    """One small online RLHF round, end to end, through the orchestrator's API:

    1. build the input from the train step's checkpoint (the reference policy) and the model the
       chat step serves through the gateway (the current policy);
    2. start the ``rlhf`` workflow; it samples the policy on the prompt pool through the gateway
       and queues the pairs as comparisons in the feedback service;
    3. meanwhile the rule-based rater pool (:mod:`.raters`) answers what the feedback
       service hands out, until the round stops waiting for preferences; the round then
       snapshots every accepted pair, trains the reward model as a job on the trainer agents,
       evaluates and registers it, runs DPO with the over-optimisation monitor and the drift
       check as jobs, and hands the policy to eval-and-promote;
    4. wait for it (cancelled when it overruns);
    5. report the round: the policy samples and their answers, reward-model accuracy with its
       interval, the monitor's last check, KL to the reference, the drift figures, and whether
       the policy was promoted: the guarded canary's decision with its evidence (requests per
       arm, p-values) and the chat traffic this step sent it (from the moment a model holds
       ``canary`` until the analysis moves it, a new ``user`` per request). A stalled wait, a refused reward model or a drift stop is a
       genuine outcome and is reported as such; a failed workflow fails the step.
    """
    # 1.
    data = rlhf_input(ctx)
    endpoint = ctx.endpoint("orchestrator")
    feedback = ctx.endpoint("preference_feedback")
    pool = RaterPool(feedback.grpc_target, feedback.token)
    stop, canary_done = asyncio.Event(), asyncio.Event()
    async with OrchestratorClient(endpoint.grpc_target, endpoint.token) as client:
        # 2.
        workflow_id = await client.start("rlhf", data, workflow_id=f"main-job-rlhf-{uuid.uuid4().hex[:8]}")
        # 3.
        raters = asyncio.create_task(pool.run(stop))
        traffic = main_job_traffic(ctx, PUBLIC_MODEL, canary_done)
        watcher = asyncio.create_task(_stop_raters_when_collected(client, workflow_id, stop))
        # 4.
        try:
            reply = await client.wait(workflow_id, timeout_s=RLHF_WAIT_S, poll_s=2.0)
        except TimeoutError:
            last = await client.get(workflow_id)
            step = last.progress.fields["step"].string_value if last.HasField("progress") else "unknown"
            await client.cancel(workflow_id, "main job: the round overran its time")
            raise RlhfStepError(
                f"rlhf workflow {workflow_id} still running after {RLHF_WAIT_S:g}s (at: {step}); cancelled"
            ) from None
        finally:
            stop.set()
            canary_done.set()
            watcher.cancel()
            answers = await raters
            sent = await traffic if traffic is not None else TrafficReport()
        result = json_format.MessageToDict(reply.result)
        canary = await _canary_of(client, result)
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        raise RlhfStepError(
            f"rlhf workflow {workflow_id} ended {status_name(reply.status)}: {reply.error or 'no error given'}"
        )
    # 5.
    elapsed = (reply.closed_at.ToDatetime() - reply.started_at.ToDatetime()).total_seconds()
    return {
        "ok": True,
        "workflow_id": workflow_id,
        **round_report(result),
        "canary": canary_summary(canary)
        or "no canary (the round handed nothing over, or nothing ran before it)",
        "canary_traffic": sent.as_dict(),
        "rater_answers": answers,
        "raters": len(pool.answered),
        "elapsed_s": round(elapsed, 1),
        "page": "/ui/admin/rlhf on the preference-feedback service",
    }


async def _canary_of(client: OrchestratorClient, result: Mapping[str, Any]) -> Mapping[str, Any]:
    """The guarded canary's entry of the round's eval-and-promote result (empty: none ran)."""
    rounds = result.get("rounds") or []
    eval_id = str(rounds[-1].get("eval_workflow_id") or "") if rounds else ""
    if not eval_id:
        return {}
    reply = await client.get(eval_id)
    return dict(json_format.MessageToDict(reply.result).get("canary") or {})


#: Steps of the round during which the raters are needed.
_COLLECTING = ("starting", "buffering", "sampling", "waiting for raters")


async def _stop_raters_when_collected(
    client: OrchestratorClient, workflow_id: str, stop: asyncio.Event
) -> None:
    """Set ``stop`` once the round no longer waits for preferences (it trains, or it ended)."""
    while not stop.is_set():
        await asyncio.sleep(2.0)
        try:
            reply = await client.get(workflow_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RETRIED_WHILE_WAITING:
                continue
            raise
        step = reply.progress.fields["step"].string_value if reply.HasField("progress") else "starting"
        if reply.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING or not any(
            s in step for s in _COLLECTING
        ):
            stop.set()


rlhf.order = 80  # type: ignore[attr-defined]
rlhf.timeout_s = RLHF_WAIT_S + 60  # type: ignore[attr-defined]
