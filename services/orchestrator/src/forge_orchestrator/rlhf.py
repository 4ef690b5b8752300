"""The RLHF workflow: rounds of reward-model retraining and policy optimisation on human preferences.

``rlhf`` (:class:`RlhfWorkflow`), each round in numbered steps:

1. **buffer**: wait (durable timers between polls) until at least ``min_new_pairs`` accepted
   pairs — A or B answers of raters that rater quality does not flag — were recorded after the
   previous round's snapshot;
2. **snapshot**: the feedback service exports the accepted pairs as an immutable, content-hashed
   snapshot (flagged raters' labels left out, with the reasons) with a held-out split;
3. **reward model**: train it as a job through the ``training`` workflow (a child; the
   ``reward_hh`` recipe on the snapshot's training split, from the reference policy);
4. **gate**: ``forge rm eval`` on the snapshot's held-out human pairs (a job through the
   ``rlhf_job`` child workflow), then register the version with its accuracy, Wilson interval
   and snapshot. Unless the interval's lower end is above 50 % the version is retired and the
   loop stops, with the reason recorded; otherwise it becomes the active version, and the
   round is pinned to it;
5. **policy round**: DPO (``dpo_hh``) on the snapshot's training pairs from the current policy
   against it as the frozen reference, through the ``training`` workflow; then a drift check
   job scores the policies of the loop so far against the original reference under the pinned
   reward model: KL, proxy reward and held-out human agreement (``policy_check``). The round
   stops — its checkpoint is not handed on — when the KL exceeds ``kl_budget``, or when the
   proxy reward rose over the last ``overopt_window`` checkpoints while held-out agreement fell
   (proxy reward is logged against sqrt(KL), as Gao et al. 2022 plot it);
6. **hand over**: the checkpoint goes to the ``eval_and_promote`` workflow (a child); when it is
   promoted the next round starts from it.

Every step is visible: the ``progress`` query (the current round and every round so far), the
workflow's log, and the round's row in the feedback service (``RecordRlhfRound``, the admin page
``/ui/admin/rlhf``). The loop ends after ``max_rounds`` rounds, at a refused gate or a drift stop.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from forge_kit.rmlength import length_gate, registry_metrics
    from forge_orchestrator.activities import SchedulerActivities, SubmitJobInput
    from forge_orchestrator.rlhf_activities import (
        PairStats,
        RegisterRewardModelInput,
        RewardModelStatusInput,
        RlhfActivities,
        RoundReportInput,
        SnapshotInfo,
    )
    from forge_orchestrator.training import AUTO_EVAL_LABEL, TrainInput, TrainResult, TrainWorkflow
    from forge_orchestrator.workflows import (
        ACTIVITY_RETRY,
        ACTIVITY_TIMEOUT,
        PROGRESS_QUERY,
        EvalAndPromoteInput,
        EvalAndPromoteResult,
        EvalAndPromoteWorkflow,
    )

FEEDBACK_TIMEOUT = timedelta(minutes=5)
"""Exports and rater-quality passes scan every preference; they get longer than plain calls."""
CHANCE = 0.5


@dataclass
class RlhfInput:
    """Input of the RLHF workflow."""

    policy_uri: str
    """The reference policy (a Hugging Face folder, e.g. an SFT checkpoint): the first round starts
    from it, reward models are initialised from it and drift is measured against it."""
    work_uri: str
    """Shared folder (path or object-store URL) where the round's evaluation jobs write results."""
    team: str = "rlhf"
    min_new_pairs: int = 64
    """Accepted pairs recorded since the previous round's snapshot before a round starts."""
    poll_s: float = 30.0
    """First wait between two counts while buffering; it doubles up to ``max_poll_s``."""
    max_poll_s: float = 600.0
    """Longest wait between two counts (bounds the history: a week of buffering is ~1,000 polls)."""
    buffer_timeout_s: float = 7 * 86400.0
    """How long one round may wait for enough new pairs before the workflow gives up."""
    heldout_fraction: float = 0.1
    reward_model_name: str = "rm-rlhf"
    reward_recipe: str = "reward_hh"
    reward_overrides: list[str] = field(default_factory=list)
    rm_length_gate: bool = True
    """Also refuse a reward model that judges length, not quality (:func:`forge_kit.rmlength.length_gate`
    on the held-out pairs whose preferred reply is the shorter one)."""
    rm_min_shorter_low: float = 0.5
    """The preferred-shorter accuracy's 95 % interval must lie above this."""
    rm_min_shorter_n: int = 1
    """Fewest held-out preferred-shorter pairs the length gate judges on (the interval widens
    with fewer by itself)."""
    dpo_recipe: str = "dpo_hh"
    dpo_overrides: list[str] = field(default_factory=list)
    kl_budget: float = 20.0
    """Nats per response: a round whose policy is further from the reference than this stops."""
    overopt_window: int = 2
    """Stop when the proxy reward rose and held-out agreement fell over this many successive
    checkpoints (the reference counts as the first point)."""
    check_max_prompts: int = 32
    check_max_new_tokens: int = 24
    max_rounds: int = 1
    python: str = "python"
    """Interpreter on the nodes (it runs the trainer and the feedback package's evaluations)."""
    gpus_per_replica: int = 1
    gpu_type: str = ""
    job_timeout_s: float = 6 * 3600.0
    checkpoint_wait_s: float = 120.0
    promote: bool = True
    """Hand each accepted checkpoint to ``eval_and_promote`` (step 6)."""
    model_name: str = "policy-rlhf"
    promote_suite: str = EvalAndPromoteInput.suite
    """Suite of the hand-over; by default eval-and-promote's own (held-out perplexity)."""
    promote_limit: int = 50
    promote_tier: str = "smoke"
    promote_endpoint: str = ""


@dataclass
class DriftPoint:
    """One checkpoint's drift figures against the original reference, under the pinned RM."""

    policy: str
    kl: float
    sqrt_kl: float
    proxy_reward: float
    heldout_agreement: float


@dataclass
class RoundRecord:
    round: int
    status: str = "running"
    """``running``, ``completed``, ``stopped`` (drift) or ``rejected`` (a gate refused)."""
    step: str = "buffering"
    new_pairs: int = 0
    snapshot_id: str = ""
    snapshot_uri: str = ""
    train_pairs: int = 0
    test_pairs: int = 0
    excluded_raters: dict[str, str] = field(default_factory=dict)
    reward_model: str = ""
    reward_model_uri: str = ""
    rm_accuracy: float = 0.0
    rm_ci95_low: float = 0.0
    rm_ci95_high: float = 0.0
    rm_n: int = 0
    policy_uri: str = ""
    drift: list[DriftPoint] = field(default_factory=list)
    """Reference first, then the loop's policies up to this round's, under this round's RM."""
    reason: str = ""
    eval_workflow_id: str = ""
    decision: str = ""
    """``promoted`` or ``blocked`` (by eval-and-promote); empty when not handed on."""


@dataclass
class RlhfResult:
    rounds: list[RoundRecord] = field(default_factory=list)
    policy_uri: str = ""
    """The policy the loop ended with (the last promoted one, else the reference)."""
    ended: str = ""
    """Why the loop ended."""


@dataclass
class JobInput:
    """A non-training job run to completion (``rlhf_job``); its outputs go where its command says."""

    team: str
    name: str
    command: list[str]
    kind: str = "eval"
    gpu_count: int = 1
    gpu_type: str = ""
    timeout_s: float = 3600.0
    max_infra_retries: int = 3


@dataclass
class JobResult:
    job_id: str
    states_seen: list[str] = field(default_factory=list)


@workflow.defn(name="rlhf_job")
class JobWorkflow(TrainWorkflow):
    """Submit one job and follow it to SUCCEEDED exactly as the training workflow does (the same
    ``job_event`` signal, requeue accounting and fail-fast), without waiting for a checkpoint."""

    @workflow.run
    async def run(self, params: JobInput) -> JobResult:  # type: ignore[override]
        info = workflow.info()
        self._step = "submitting"
        await workflow.execute_activity_method(
            SchedulerActivities.ensure_team,
            params.team,
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            retry_policy=ACTIVITY_RETRY,
        )
        self._job_id = await workflow.execute_activity_method(
            SchedulerActivities.submit_job,
            SubmitJobInput(
                name=params.name,
                team=params.team,
                command=params.command,
                request_id=f"{info.workflow_id}/{info.run_id}/job",
                labels={"workflow_id": info.workflow_id},
                gpu_count=params.gpu_count,
                gpu_type=params.gpu_type,
                kind=params.kind,
            ),
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            retry_policy=ACTIVITY_RETRY,
        )
        follow = TrainInput(
            team=params.team,
            recipe=params.name,
            timeout_s=params.timeout_s,
            max_infra_retries=params.max_infra_retries,
        )
        try:
            await self._follow(follow)
        except BaseException:
            self._step = "failed"
            raise
        self._step = "done"
        return JobResult(job_id=self._job_id, states_seen=self._states())


def reward_gate(summary: dict[str, Any], chance: float = CHANCE) -> str:
    """Why a reward model may not be used (empty when it may): its held-out accuracy must beat
    ``chance`` significantly, i.e. the 95 % interval's lower end lies above it."""
    for key in ("accuracy", "ci95_low", "ci95_high", "n"):
        if key not in summary:
            return f"rm eval summary has no {key!r}"
    low = float(summary["ci95_low"])
    if low > chance:
        return ""
    return (
        f"held-out pairwise accuracy {float(summary['accuracy']):.3f} "
        f"[{low:.3f}, {float(summary['ci95_high']):.3f}] on n={int(summary['n'])} human pairs does not "
        f"beat {chance:.0%} significantly (the 95% interval reaches {chance:.0%})"
    )


def rm_gate(summary: dict[str, Any], params: RlhfInput) -> str:
    """Why a round's reward model may not be used (empty when it may): :func:`reward_gate`, then
    (``params.rm_length_gate``) :func:`forge_kit.rmlength.length_gate` on its held-out pairs whose
    preferred reply is the shorter one."""
    if reason := reward_gate(summary):
        return reason
    if not params.rm_length_gate:
        return ""
    return length_gate(
        summary, min_shorter_low=params.rm_min_shorter_low, min_shorter_n=params.rm_min_shorter_n
    )


def drift_stop(points: list[DriftPoint], kl_budget: float, window: int) -> str:
    """Why the newest point ends the round (empty when it does not).

    1. KL budget: the newest policy is more than ``kl_budget`` nats from the reference.
    2. Over-optimisation: over the last ``window`` steps (``window + 1`` points) the proxy reward
       rose at every step while held-out human agreement fell at every step.
    """
    if not points:
        return ""
    newest = points[-1]
    if newest.kl > kl_budget:
        return f"KL to the reference {newest.kl:.3f} nats exceeds the budget {kl_budget:g}"
    if window >= 1 and len(points) > window:
        tail = points[-(window + 1) :]
        steps = list(itertools.pairwise(tail))
        if all(b.proxy_reward > a.proxy_reward for a, b in steps) and all(
            b.heldout_agreement < a.heldout_agreement for a, b in steps
        ):
            trace = ", ".join(
                f"sqrt(KL)={p.sqrt_kl:.3f}: proxy {p.proxy_reward:.3f}, agreement {p.heldout_agreement:.3f}"
                for p in tail
            )
            return (
                f"over-optimisation: proxy reward rose while held-out human agreement fell over the last "
                f"{window} checkpoint(s) ({trace})"
            )
    return ""


_VERSION_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def rm_version(workflow_id: str, round_number: int) -> str:
    """A registry version unique to the round (so a retried registration finds its own)."""
    return f"{_VERSION_CHARS.sub('-', workflow_id)[:48]}.r{round_number}"


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


@workflow.defn(name="rlhf")
class RlhfWorkflow:
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
                # 1. Buffer.
                stats = await self._buffer(params, watermark, record)
                record.new_pairs = stats.accepted_since
                # 2. Snapshot.
                record.step = "exporting snapshot"
                await self._report(record, new_pairs=float(stats.accepted_since))
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

    async def _buffer(self, params: RlhfInput, watermark: str, record: RoundRecord) -> PairStats:
        deadline = workflow.now() + timedelta(seconds=params.buffer_timeout_s)
        poll = params.poll_s
        while True:
            stats: PairStats = await self._activity(
                RlhfActivities.preference_stats, watermark, FEEDBACK_TIMEOUT
            )
            record.new_pairs = stats.accepted_since
            record.step = f"buffering ({stats.accepted_since}/{params.min_new_pairs} new accepted pairs)"
            self._step = f"round {record.round}: {record.step}"
            if stats.accepted_since >= params.min_new_pairs:
                return stats
            if workflow.now() >= deadline:
                await self._end(
                    record,
                    "rejected",
                    f"only {stats.accepted_since} new accepted pairs within {params.buffer_timeout_s:g}s "
                    f"(need {params.min_new_pairs})",
                )
                raise ApplicationError(record.reason, type="BufferTimeout", non_retryable=True)
            await workflow.sleep(timedelta(seconds=poll))
            poll = min(poll * 2, max(params.max_poll_s, params.poll_s))

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
            # eval-and-promote after the drift check: the checkpoint router must not as well.
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
                    f"pairs.path={_join(record.snapshot_uri, 'train.jsonl.gz')}",
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
        out = _join(params.work_uri, wid, f"round-{n}", "rm-eval")
        await self._job(
            params,
            f"{wid}-r{n}-rm-eval",
            f"rm-eval-r{n}",
            [
                params.python,
                "-m",
                "forge_preference_feedback.rm_cli",
                "eval",
                "--checkpoint",
                record.reward_model_uri,
                "--pairs",
                _join(record.snapshot_uri, "test.jsonl.gz"),
                "--out",
                out,
            ],
        )
        summary: dict[str, Any] = await self._activity(RlhfActivities.read_json, _join(out, "summary.json"))
        reason = rm_gate(summary, params)
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

    async def _policy_round(self, params: RlhfInput, record: RoundRecord) -> bool:
        """Step 5; True when a drift check stopped the round."""
        wid = workflow.info().workflow_id
        n = record.round
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
                    f"pairs.path={_join(record.snapshot_uri, 'train.jsonl.gz')}",
                    *params.dpo_overrides,
                ],
            ),
            id=f"{wid}-r{n}-dpo",
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        assert trained.checkpoint is not None
        record.policy_uri = trained.checkpoint.uri
        record.step = "drift check"
        await self._report(record)
        out = _join(params.work_uri, wid, f"round-{n}", "policy-check")
        policies = [*self._accepted[-params.overopt_window :], record.policy_uri]
        command = [
            params.python,
            "-m",
            "forge_preference_feedback.policy_check",
            "--reference",
            params.policy_uri,
            "--reward-model",
            record.reward_model_uri,
            "--pairs",
            _join(record.snapshot_uri, "test.jsonl.gz"),
            "--out",
            out,
            "--max-prompts",
            str(params.check_max_prompts),
            "--max-new-tokens",
            str(params.check_max_new_tokens),
            "--seed",
            str(n),
        ]
        for policy in policies:
            command += ["--policy", policy]
        await self._job(params, f"{wid}-r{n}-check", f"policy-check-r{n}", command)
        summary: dict[str, Any] = await self._activity(RlhfActivities.read_json, _join(out, "summary.json"))
        reference = DriftPoint(
            policy=params.policy_uri,
            kl=0.0,
            sqrt_kl=0.0,
            proxy_reward=float(summary["reference_proxy_reward"]),
            heldout_agreement=CHANCE,
        )
        record.drift = [reference, *(DriftPoint(**{k: p[k] for k in _POINT_KEYS}) for p in summary["points"])]
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
        await self._end(record, "completed", outcome.blocked_reason)


_POINT_KEYS = ("policy", "kl", "sqrt_kl", "proxy_reward", "heldout_agreement")

#: The workflows the RLHF worker runs: the loop and the children it starts.
RLHF_WORKFLOWS: tuple[type, ...] = (RlhfWorkflow, JobWorkflow, TrainWorkflow, EvalAndPromoteWorkflow)
