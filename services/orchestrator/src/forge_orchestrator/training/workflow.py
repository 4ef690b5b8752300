"""The training workflow: one training run through the scheduler and the trainer agents.

``training`` (:class:`TrainWorkflow`), in numbered steps:

1. ensure the team exists (its quota is an admin's business; only for an admin caller — a team
   caller's team exists) and submit the job with the caller's rights (a team caller's job is its
   team's submission, ``on_behalf_of``) — a gang of ``replicas`` × ``gpus_per_replica``,
   checkpointable, labelled with this workflow's id;
2. follow its state changes (the ``job_event`` signal from the Kafka consumer):
   - PENDING after it ran: it was requeued. A preemption is expected (the job resumes from its
     last checkpoint on its next start); a lost node is an infrastructure failure and counts
     against ``max_infra_retries`` — beyond it the job is cancelled and the workflow fails;
   - FAILED: the job's own error (a non-zero exit of one replica). The workflow fails at once,
     with the scheduler's reason, and never retries: a crash in the code would only repeat;
   - CANCELLED: someone cancelled it; the workflow fails;
   - SUCCEEDED: go on;
3. wait for the run's published checkpoint (the ``checkpoint_published`` signal, sent by the
   consumer of ``CheckpointPublished`` for the job this workflow submitted);
4. return the job, the states seen, the requeues and the checkpoint (where its Hugging Face
   export is, its step and metrics).

Cancelling the workflow cancels the job.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.activities import SubmitJobInput
    from forge_orchestrator.identity import ADMIN
    from forge_orchestrator.inbox import JobEventInbox
    from forge_orchestrator.training.model import (
        CHECKPOINT_SIGNAL,
        CheckpointInfo,
        TrainInput,
        TrainResult,
        command_of,
    )


@workflow.defn(name="training")
class TrainWorkflow(JobEventInbox):
    def __init__(self) -> None:
        super().__init__()
        self._checkpoints: list[CheckpointInfo] = []
        self._handled = 0

    @workflow.signal(name=CHECKPOINT_SIGNAL)
    def checkpoint_published(self, checkpoint: CheckpointInfo) -> None:
        if self._first_time(checkpoint.event_id):
            self._checkpoints.append(checkpoint)

    @workflow.run
    async def run(self, params: TrainInput) -> TrainResult:
        started = workflow.now()
        info = workflow.info()
        try:
            # 1. Team and job.
            caller = params.caller or ADMIN
            job = SubmitJobInput(
                name=params.name,
                team=params.team,
                command=command_of(params),
                request_id=f"{info.workflow_id}/{info.run_id}/train",
                priority_class=params.priority_class,
                labels={**params.labels, "recipe": params.recipe},
                workflow_id=info.workflow_id,
                auto_eval=params.auto_eval,
                gpu_count=params.gpus_per_replica,
                gpu_type=params.gpu_type,
                replicas=params.replicas,
                checkpointable=True,
                kind="training",
                on_behalf_of=caller.on_behalf_of,
            )
            await self._submit(job, caller)
            # 2. Follow the job to its end.
            preemptions, infra = await self._follow(params)
            # 3. Its checkpoint.
            self._step = "waiting for the checkpoint"
            try:
                await workflow.wait_condition(
                    lambda: bool(self._checkpoints), timeout=timedelta(seconds=params.checkpoint_wait_s)
                )
            except TimeoutError:
                raise ApplicationError(
                    f"job {self._job_id} succeeded but published no checkpoint within "
                    f"{params.checkpoint_wait_s:g}s",
                    type="NoCheckpoint",
                    non_retryable=True,
                ) from None
        except asyncio.CancelledError:
            if self._job_id:
                self._step = "cancelled"
                await self._cancel_job("workflow cancelled")
            raise
        # 4. Result.
        self._step = "done"
        return TrainResult(
            job_id=self._job_id,
            states_seen=self._states(),
            preemptions=preemptions,
            infra_retries=infra,
            checkpoint=max(self._checkpoints, key=lambda c: c.step),
            elapsed_s=round((workflow.now() - started).total_seconds(), 3),
        )

    async def _follow(self, params: TrainInput) -> tuple[int, int]:
        """Wait for SUCCEEDED; count requeues; fail fast on the job's own failure."""
        self._handled = 0
        ran = False
        preemptions = infra = 0
        deadline = workflow.now() + timedelta(seconds=params.timeout_s)
        while True:
            self._step = f"following job ({', '.join(self._states()[-3:]) or 'submitted'})"
            left = (deadline - workflow.now()).total_seconds()
            try:
                await workflow.wait_condition(
                    lambda: len(self._mine()) > self._handled,
                    timeout=timedelta(seconds=max(1.0, left)),
                )
            except TimeoutError:
                await self._cancel_job(f"training did not finish within {params.timeout_s:g}s")
                raise ApplicationError(
                    f"job {self._job_id} did not succeed within {params.timeout_s:g}s",
                    type="TrainTimeout",
                    non_retryable=True,
                ) from None
            for event in self._mine()[self._handled :]:
                if event.state in ("SCHEDULED", "RUNNING"):
                    ran = True
                elif event.state == "PENDING" and ran:
                    ran = False
                    if "lost" in event.reason:
                        infra += 1
                        if infra > params.max_infra_retries:
                            await self._cancel_job("too many infrastructure failures")
                            raise ApplicationError(
                                f"job {self._job_id} lost its node {infra} times (limit "
                                f"{params.max_infra_retries}): {event.reason}",
                                type="InfraRetriesExhausted",
                                non_retryable=True,
                            )
                    else:
                        preemptions += 1
                elif event.state == "SUCCEEDED":
                    return preemptions, infra
                elif event.state in ("FAILED", "CANCELLED"):
                    raise ApplicationError(
                        f"job {self._job_id} {event.state.lower()}: {event.reason or 'no reason given'}",
                        type=f"Job{event.state.title()}",
                        non_retryable=True,
                    )
            self._handled = len(self._mine())
