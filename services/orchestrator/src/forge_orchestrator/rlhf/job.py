"""``rlhf_job``: one non-training job of the RLHF loop (a reward-model evaluation, a drift check)
submitted and followed to SUCCEEDED exactly as the training workflow follows its jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.activities import SubmitJobInput
    from forge_orchestrator.identity import ADMIN
    from forge_orchestrator.training.model import TrainInput
    from forge_orchestrator.training.workflow import TrainWorkflow


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
        job = SubmitJobInput(
            name=params.name,
            team=params.team,
            command=params.command,
            request_id=f"{info.workflow_id}/{info.run_id}/job",
            labels={"workflow_id": info.workflow_id},
            gpu_count=params.gpu_count,
            gpu_type=params.gpu_type,
            kind=params.kind,
        )
        await self._submit(job, ADMIN)  # the RLHF loop acts as the admin: the team is ensured
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
