"""The RLHF workflow: rounds of preference collection on the current policy's own samples,
reward-model retraining and policy optimisation.

``rlhf`` (:class:`RlhfWorkflow`), each round in numbered steps:

1. **preferences** (:mod:`.collect`): online, sample the current policy (``sample_model``,
   through the inference gateway) on prompts of the prompt pool — a dataset plus production
   prompts of tenants that allowed training — and queue the pairs for raters, then wait for
   ``min_policy_pairs`` accepted preferences on them; offline (no ``sample_model``), wait for
   ``min_new_pairs`` accepted pairs since the previous snapshot. Raters who do not answer before
   the deadline end the round ``stalled`` with the counts;
2. **snapshot**: the feedback service exports every accepted pair so far as an immutable,
   content-hashed snapshot (flagged raters' labels left out, with the reasons) with a held-out
   split;
3. **reward model**: train it as a job through the ``training`` workflow (a child; the
   ``reward_hh`` recipe on the snapshot's training split, from the reference policy);
4. **gate**: ``forge rm eval`` on the snapshot's held-out human pairs (a job through the
   ``rlhf_job`` child workflow), then register the version with its accuracy, Wilson interval
   and snapshot. Unless :func:`~.model.reward_gate` passes, the version is retired and the
   loop stops, with the reason recorded; otherwise it becomes the active version, and the round
   is pinned to it;
5. **policy round**: DPO (``dpo_hh``) on the snapshot's training pairs from the current policy
   against it as the frozen reference, through the ``training`` workflow. With
   ``monitor_interval`` K, the trainer scores KL to the reference, the proxy reward of the
   policy's samples under the pinned reward model and held-out human agreement every K steps
   **during** training and stops early when over-optimisation shows (proxy reward up, held-out
   agreement down); the trace is the round's ``training_monitor``. Then a drift check job scores
   the loop's policies against the original reference (``policy_check``); the round stops — its
   checkpoint is not handed on — when the KL exceeds ``kl_budget`` or over-optimisation shows
   across checkpoints;
6. **hand over**: the checkpoint goes to the ``eval_and_promote`` workflow (a child); when it is
   promoted the next round starts from it.

Every step is visible: the ``progress`` query (the current round and every round so far), the
workflow's log, and the round's row in the feedback service (``RecordRlhfRound``, the admin page
``/ui/admin/rlhf``). The loop ends after ``max_rounds`` rounds, at a stalled wait, a refused gate
or a drift stop.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from forge_experiments.jobcmd import PolicyCheckCommand, RewardModelEvalCommand
    from forge_experiments.rmlength import registry_metrics
    from forge_orchestrator.inbox import ACTIVITY_RETRY, ACTIVITY_TIMEOUT, PROGRESS_QUERY
    from forge_orchestrator.promote.model import EvalAndPromoteInput, EvalAndPromoteResult
    from forge_orchestrator.promote.workflow import EvalAndPromoteWorkflow
    from forge_orchestrator.rlhf.activities import (
        RegisterRewardModelInput,
        RewardModelStatusInput,
        RlhfActivities,
        RoundReportInput,
        SnapshotInfo,
    )
    from forge_orchestrator.rlhf.collect import FEEDBACK_TIMEOUT, RoundCollection
    from forge_orchestrator.rlhf.job import JobInput, JobResult, JobWorkflow
    from forge_orchestrator.rlhf.model import (
        CHANCE,
        POINT_KEYS,
        DriftPoint,
        RlhfInput,
        RlhfResult,
        RoundRecord,
        drift_stop,
        join,
        reward_gate,
        rm_version,
        round_gates,
    )
    from forge_orchestrator.routing import AUTO_EVAL_LABEL
    from forge_orchestrator.training.model import TrainInput, TrainResult
    from forge_orchestrator.training.workflow import TrainWorkflow

__all__ = ["RLHF_WORKFLOWS", "RlhfInput", "RlhfResult", "RlhfWorkflow"]


@workflow.defn(name="rlhf")
class RlhfWorkflow(RoundCollection):
    def __init__(self) -> None:
        self._rounds: list[RoundRecord] = []
        self._policy = ""
        self._accepted: list[str] = []
        self._step = "starting"

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, object]:
        return {
            "step": self._step,
            "round": len(self._rounds),
            "policy_uri": self._policy,
            "rounds": [dataclasses.asdict(r) for r in self._rounds],
        }

    async def _activity(self, method: Any, arg: Any, timeout: timedelta = ACTIVITY_TIMEOUT) -> Any:
        return await workflow.execute_activity_method(
            method, arg, start_to_close_timeout=timeout, retry_policy=ACTIVITY_RETRY
        )

    async def _report(self, record: RoundRecord, **metrics: float) -> None:
        """The round's state to the query (always current) and to the feedback service's page."""
        self._step = f"round {record.round}: {record.step}"
        workflow.logger.info(
            "rlhf round %d %s: %s%s",
            record.round,
            record.status,
            record.step,
            f" ({record.reason})" if record.reason else "",
        )
        await self._activity(
            RlhfActivities.record_round,
            RoundReportInput(
                workflow_id=workflow.info().workflow_id,
                round=record.round,
                status=record.status,
                step=record.step,
                snapshot_id=record.snapshot_id,
                reward_model=record.reward_model,
                policy_uri=record.policy_uri,
                reason=record.reason,
                metrics=metrics,
            ),
        )

    @workflow.run
    async def run(self, params: RlhfInput) -> RlhfResult:
        self._policy = params.policy_uri
        watermark = ""
        ended = f"ran {params.max_rounds} round(s)"
        for number in range(1, params.max_rounds + 1):
            record = RoundRecord(round=number)
            self._rounds.append(record)
            await self._report(record)
            try:
                # 1. Preferences: the policy's own samples rated (online), or whatever arrives.
                if params.sample_model:
                    if not await self._collect(params, record):
                        ended = record.reason
                        break
                else:
                    stats = await self._buffer(params, watermark, record)
                    if stats is None:
                        ended = record.reason
                        break
                    record.new_pairs = stats.accepted_since
                # 2. Snapshot.
                record.step = "exporting snapshot"
                await self._report(record, new_pairs=float(record.new_pairs))
                snapshot: SnapshotInfo = await self._activity(
                    RlhfActivities.export_snapshot, params.heldout_fraction, FEEDBACK_TIMEOUT
                )
                watermark = snapshot.last_recorded_at or watermark
                record.snapshot_id, record.snapshot_uri = snapshot.snapshot_id, snapshot.uri
                record.train_pairs, record.test_pairs = snapshot.train_pairs, snapshot.test_pairs
                record.excluded_raters = dict(snapshot.excluded_raters)
                if snapshot.test_pairs == 0 or snapshot.train_pairs == 0:
                    await self._end(
                        record,
                        "rejected",
                        f"snapshot {snapshot.snapshot_id} has {snapshot.train_pairs} training and "
                        f"{snapshot.test_pairs} held-out pairs; both are needed",
                    )
                    ended = record.reason
                    break
                # 3-4. Reward model, gate, registry.
                gate = await self._reward_model(params, record)
                if gate:
                    ended = record.reason
                    break
                # 5. Policy round and drift checks.
                stop = await self._policy_round(params, record)
                if stop:
                    ended = record.reason
                    break
                # 6. Eval and promote.
                await self._hand_over(params, record)
            except ApplicationError:
                raise
            except Exception as exc:  # a child or activity failed: the round is over, say so
                if record.status == "running":
                    record.status, record.reason = "rejected", f"{record.step} failed: {exc}"
                    await self._report(record)
                raise
        self._step = "done"
        return RlhfResult(rounds=self._rounds, policy_uri=self._policy, ended=ended)

    async def _end(self, record: RoundRecord, status: str, reason: str, **metrics: float) -> None:
        record.status, record.reason = status, reason
        await self._report(record, **metrics)

    def _train(self, params: RlhfInput, name: str, recipe: str, overrides: list[str]) -> TrainInput:
        return TrainInput(
            team=params.team,
            recipe=recipe,
            name=name,
            overrides=overrides,
            gpus_per_replica=params.gpus_per_replica,
            gpu_type=params.gpu_type,
            python=params.python,
            timeout_s=params.job_timeout_s,
            checkpoint_wait_s=params.checkpoint_wait_s,
            # The loop gates its reward model itself and hands the DPO checkpoint to
            # eval-and-promote after the drift check: the checkpoint handler must not as well.
            labels={AUTO_EVAL_LABEL: "false"},
        )

    async def _job(self, params: RlhfInput, child_id: str, name: str, command: list[str]) -> JobResult:
        result: JobResult = await workflow.execute_child_workflow(
            JobWorkflow.run,
            JobInput(
                team=params.team,
                name=name,
                command=command,
                gpu_count=params.gpus_per_replica,
                gpu_type=params.gpu_type,
                timeout_s=params.job_timeout_s,
            ),
            id=child_id,
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        return result

    async def _reward_model(self, params: RlhfInput, record: RoundRecord) -> bool:
        """Steps 3-4; True when the gate refused the reward model (the round is rejected)."""
        wid = workflow.info().workflow_id
        n = record.round
        record.step = "training reward model"
        await self._report(record, train_pairs=float(record.train_pairs), test_pairs=float(record.test_pairs))
        trained: TrainResult = await workflow.execute_child_workflow(
            TrainWorkflow.run,
            self._train(
                params,
                f"rm-r{n}",
                params.reward_recipe,
                [
                    f"init.parent={params.policy_uri}",
                    f"pairs.path={join(record.snapshot_uri, 'train.jsonl.gz')}",
                    *params.reward_overrides,
                ],
            ),
            id=f"{wid}-r{n}-rm",
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        assert trained.checkpoint is not None  # the training workflow fails without one
        record.reward_model_uri = trained.checkpoint.uri
        record.step = "evaluating reward model on held-out human pairs"
        await self._report(record)
        out = join(params.work_uri, wid, f"round-{n}", "rm-eval")
        await self._job(
            params,
            f"{wid}-r{n}-rm-eval",
            f"rm-eval-r{n}",
            RewardModelEvalCommand(
                checkpoint=record.reward_model_uri,
                pairs=join(record.snapshot_uri, "test.jsonl.gz"),
                out=out,
                python=params.python,
            ).argv(),
        )
        summary: dict[str, Any] = await self._activity(RlhfActivities.read_json, join(out, "summary.json"))
        reason = reward_gate(summary, gates=round_gates(params))
        record.rm_accuracy = float(summary.get("accuracy", 0.0))
        record.rm_ci95_low = float(summary.get("ci95_low", 0.0))
        record.rm_ci95_high = float(summary.get("ci95_high", 0.0))
        record.rm_n = int(summary.get("n", 0))
        version = rm_version(wid, n)
        record.step = "registering reward model"
        record.reward_model = await self._activity(
            RlhfActivities.register_reward_model,
            RegisterRewardModelInput(
                name=params.reward_model_name,
                version=version,
                uri=record.reward_model_uri,
                snapshot_id=record.snapshot_id,
                backbone=params.policy_uri,
                accuracy=record.rm_accuracy,
                ci95_low=record.rm_ci95_low,
                ci95_high=record.rm_ci95_high,
                n=record.rm_n,
                metrics={
                    **{k: float(v) for k, v in trained.checkpoint.metrics.items()},
                    **registry_metrics(summary),
                },
            ),
        )
        figures = {
            "rm_accuracy": record.rm_accuracy,
            "rm_ci95_low": record.rm_ci95_low,
            "rm_ci95_high": record.rm_ci95_high,
            "rm_n": float(record.rm_n),
        }
        status = "retired" if reason else "active"
        await self._activity(
            RlhfActivities.set_reward_model_status,
            RewardModelStatusInput(params.reward_model_name, version, status),
        )
        if reason:
            record.step = "reward model refused"
            await self._end(record, "rejected", f"reward model {record.reward_model}: {reason}", **figures)
            return True
        record.step = f"reward model {record.reward_model} active"
        await self._report(record, **figures)
        return False

    @staticmethod
    def _monitor_overrides(params: RlhfInput, record: RoundRecord, out: str) -> list[str]:
        """The DPO job's in-training over-optimisation monitor (off without ``monitor_interval``):
        every K steps, KL and proxy reward under the round's pinned reward model, held-out
        agreement on the pairs DPO holds out; the trace goes to ``out``."""
        if not params.monitor_interval:
            return []
        return [
            f"dpo.monitor.interval={params.monitor_interval}",
            f"dpo.monitor.reward_model={record.reward_model_uri}",
            f"dpo.monitor.window={params.overopt_window}",
            f"dpo.monitor.max_new_tokens={params.check_max_new_tokens}",
            f"dpo.monitor.out={out}",
        ]

    async def _policy_round(self, params: RlhfInput, record: RoundRecord) -> bool:
        """Step 5; True when a drift check stopped the round."""
        wid = workflow.info().workflow_id
        n = record.round
        monitor = join(params.work_uri, wid, f"round-{n}", "dpo-monitor.json")
        record.step = f"DPO against {self._policy} (pinned to {record.reward_model})"
        await self._report(record)
        trained: TrainResult = await workflow.execute_child_workflow(
            TrainWorkflow.run,
            self._train(
                params,
                f"dpo-r{n}",
                params.dpo_recipe,
                [
                    f"init.parent={self._policy}",
                    f"pairs.path={join(record.snapshot_uri, 'train.jsonl.gz')}",
                    *self._monitor_overrides(params, record, monitor),
                    *params.dpo_overrides,
                ],
            ),
            id=f"{wid}-r{n}-dpo",
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        assert trained.checkpoint is not None
        record.policy_uri = trained.checkpoint.uri
        if params.monitor_interval:
            trace: dict[str, Any] = await self._activity(RlhfActivities.read_json, monitor)
            record.training_monitor = [
                {k: float(v) for k, v in p.items() if isinstance(v, int | float)}
                for p in trace.get("points", [])
            ]
            record.early_stop = str(trace.get("early_stop", ""))
            if record.early_stop:
                workflow.logger.info("rlhf round %d: DPO stopped early: %s", n, record.early_stop)
        record.step = "drift check" + (
            f" (DPO stopped early: {record.early_stop})" if record.early_stop else ""
        )
        await self._report(record)
        out = join(params.work_uri, wid, f"round-{n}", "policy-check")
        policies = [*self._accepted[-params.overopt_window :], record.policy_uri]
        command = PolicyCheckCommand(
            reference=params.policy_uri,
            reward_model=record.reward_model_uri,
            pairs=join(record.snapshot_uri, "test.jsonl.gz"),
            out=out,
            policies=policies,
            max_prompts=params.check_max_prompts,
            max_new_tokens=params.check_max_new_tokens,
            seed=n,
            python=params.python,
        ).argv()
        await self._job(params, f"{wid}-r{n}-check", f"policy-check-r{n}", command)
        summary: dict[str, Any] = await self._activity(RlhfActivities.read_json, join(out, "summary.json"))
        reference = DriftPoint(
            policy=params.policy_uri,
            kl=0.0,
            sqrt_kl=0.0,
            proxy_reward=float(summary["reference_proxy_reward"]),
            heldout_agreement=CHANCE,
        )
        record.drift = [reference, *(DriftPoint(**{k: p[k] for k in POINT_KEYS}) for p in summary["points"])]
        for point in record.drift:
            workflow.logger.info(
                "rlhf round %d drift: sqrt(KL)=%.4f proxy_reward=%.4f heldout_agreement=%.3f (%s)",
                n,
                point.sqrt_kl,
                point.proxy_reward,
                point.heldout_agreement,
                point.policy,
            )
        newest = record.drift[-1]
        figures = {
            "kl": newest.kl,
            "sqrt_kl": newest.sqrt_kl,
            "proxy_reward": newest.proxy_reward,
            "reference_proxy_reward": reference.proxy_reward,
            "heldout_agreement": newest.heldout_agreement,
        }
        reason = drift_stop(record.drift, params.kl_budget, params.overopt_window)
        if reason:
            record.step = "stopped by drift check"
            await self._end(record, "stopped", reason, **figures)
            return True
        record.step = "drift check passed"
        await self._report(record, **figures)
        return False

    async def _hand_over(self, params: RlhfInput, record: RoundRecord) -> None:
        wid = workflow.info().workflow_id
        if not params.promote:
            self._accepted.append(record.policy_uri)
            self._policy = record.policy_uri
            record.step = "done (not handed to eval-and-promote)"
            await self._end(record, "completed", "")
            return
        record.eval_workflow_id = f"{wid}-r{record.round}-eval"
        record.step = f"eval and promote ({record.eval_workflow_id})"
        await self._report(record)
        outcome: EvalAndPromoteResult = await workflow.execute_child_workflow(
            EvalAndPromoteWorkflow.run,
            EvalAndPromoteInput(
                model_name=params.model_name,
                model_version=rm_version(wid, record.round).replace(".r", "-r"),
                uri=record.policy_uri,
                suite=params.promote_suite,
                limit=params.promote_limit,
                tier=params.promote_tier,
                endpoint=params.promote_endpoint,
                data_hash=record.snapshot_id,
                training_run_id=f"{wid}-r{record.round}-dpo",
            ),
            id=record.eval_workflow_id,
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        record.decision = outcome.decision
        if outcome.decision == "promoted":
            self._accepted.append(record.policy_uri)
            self._policy = record.policy_uri
        record.step = f"eval and promote: {outcome.decision}"
        canary = outcome.canary
        note = outcome.blocked_reason or (
            f"canary {canary['decision']} after {canary['decided_after_s']}s: {canary['reason']}"
            if canary
            else ""
        )
        await self._end(record, "completed", note)


#: The workflows the RLHF worker runs: the loop and the children it starts.
RLHF_WORKFLOWS: tuple[type, ...] = (RlhfWorkflow, JobWorkflow, TrainWorkflow, EvalAndPromoteWorkflow)
