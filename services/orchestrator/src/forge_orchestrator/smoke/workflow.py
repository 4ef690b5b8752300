"""The ``smoke`` workflow: a no-op job through the scheduler, its events back through Kafka and
this service's consumer. Deterministic: time from ``workflow.now()``, ids from ``workflow.uuid4()``,
every call to another service through an activity (:mod:`forge_orchestrator.activities`)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.activities import SubmitJobInput
    from forge_orchestrator.identity import ADMIN
    from forge_orchestrator.inbox import JobEventInbox
    from forge_orchestrator.smoke.model import SmokeInput, SmokeResult


@workflow.defn(name="smoke")
class SmokeWorkflow(JobEventInbox):
    """The platform's smoke job: a job goes through the scheduler and its events come back.

    1. ensure the team and submit a no-op job labelled with this workflow's id;
    2. wait for its PENDING event (scheduler → Kafka → this service's consumer → signal);
    3. optionally hold it for ``hold_s``, then cancel it and wait for its end: CANCELLED, or
       SUCCEEDED when an agent already ran it (the job is ``true``);
    4. return the job id, the states seen in order and the elapsed workflow time.

    Cancelling the workflow cancels the job it submitted.
    """

    async def _wait_for(self, state: str, timeout_s: float, *alternatives: str) -> None:
        wanted = {state, *alternatives}
        self._step = f"waiting for {' or '.join(sorted(wanted))}"
        try:
            await workflow.wait_condition(
                lambda: bool(wanted & set(self._states())), timeout=timedelta(seconds=timeout_s)
            )
        except TimeoutError:
            raise ApplicationError(
                f"no {' or '.join(sorted(wanted))} event for job {self._job_id} within {timeout_s:g}s",
                type="JobEventTimeout",
                non_retryable=True,
            ) from None

    @workflow.run
    async def run(self, params: SmokeInput) -> SmokeResult:
        started = workflow.now()
        info = workflow.info()
        try:
            # 1. Team and job.
            caller = params.caller or ADMIN
            job = SubmitJobInput(
                name=f"smoke-{workflow.uuid4().hex[:8]}",
                team=params.team,
                command=["true"],
                request_id=f"{info.workflow_id}/{info.run_id}/smoke",
                labels={"workflow_id": info.workflow_id},
                on_behalf_of=caller.on_behalf_of,
            )
            await self._submit(job, caller)
            # 2. Its PENDING event.
            await self._wait_for("PENDING", params.timeout_s)
            # 3. Hold, cancel, and its CANCELLED event.
            if params.hold_s > 0:
                self._step = "holding"
                await workflow.sleep(timedelta(seconds=params.hold_s))
            self._step = "cancelling"
            await self._cancel_job("smoke workflow finished")
            await self._wait_for("CANCELLED", params.timeout_s, "SUCCEEDED")
        except asyncio.CancelledError:
            if self._job_id:
                self._step = "cancelled"
                await self._cancel_job("workflow cancelled")
            raise
        # 4. Result.
        self._step = "done"
        elapsed = (workflow.now() - started).total_seconds()
        return SmokeResult(job_id=self._job_id, states_seen=self._states(), elapsed_s=round(elapsed, 3))
