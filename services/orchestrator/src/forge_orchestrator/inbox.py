"""The base of every workflow that submits a scheduler job and follows it: the job-event inbox,
the progress query, and submitting and cancelling the job.

Workflows that wait on scheduler jobs receive the job's state changes as the ``job_event`` signal,
sent by this process's Kafka consumer (``event_handlers.JobEventHandler``) for every job labelled with
the workflow's id. Signals may repeat (at-least-once delivery); each carries its event id and a
workflow applies an event id once. Deterministic, as workflow code must be.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.activities import CancelJobInput, SchedulerActivities, SubmitJobInput
    from forge_orchestrator.identity import Caller

#: Name of the signal carrying a job's state change.
JOB_EVENT_SIGNAL = "job_event"
#: Name of the query every workflow answers with a small progress dict.
PROGRESS_QUERY = "progress"

ACTIVITY_TIMEOUT = timedelta(seconds=30)
ACTIVITY_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=500),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
)


@dataclass
class JobEvent:
    """Payload of the ``job_event`` signal."""

    job_id: str
    state: str
    """State name without prefix: ``PENDING``, ``RUNNING``, ``CANCELLED`` …"""
    event_id: str = ""
    reason: str = ""
    """The scheduler's reason for the change (a failure's exit code and log tail, a lost node …)."""


class JobEventInbox:
    """Base of a workflow that follows one job (``_job_id``): the ``job_event`` signal, applied
    once per event id, and the ``progress`` query (its ``_step``, the job and its states seen)."""

    def __init__(self) -> None:
        self._events: list[JobEvent] = []
        self._event_ids: set[str] = set()
        self._job_id = ""
        self._step = "starting"

    def _first_time(self, event_id: str) -> bool:
        """Record ``event_id``; False when it was seen before (an empty id is never a repeat)."""
        if event_id and event_id in self._event_ids:
            return False
        self._event_ids.add(event_id)
        return True

    @workflow.signal(name=JOB_EVENT_SIGNAL)
    def job_event(self, event: JobEvent) -> None:
        if self._first_time(event.event_id):
            self._events.append(event)

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, object]:
        return {"step": self._step, "job_id": self._job_id, "states_seen": self._states()}

    def _mine(self) -> list[JobEvent]:
        """Events of the job this workflow follows (the job-event handler may signal others it submitted)."""
        return [e for e in self._events if e.job_id == self._job_id]

    def _states(self) -> list[str]:
        return [e.state for e in self._mine()]

    async def _submit(self, job: SubmitJobInput, caller: Caller) -> None:
        """Submit ``job`` and follow it: the team is ensured first for an admin caller (a team
        caller's team exists; creating teams is an admin's)."""
        self._step = "submitting"
        if caller.is_admin:
            await workflow.execute_activity_method(
                SchedulerActivities.ensure_team,
                job.team,
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                retry_policy=ACTIVITY_RETRY,
            )
        self._job_id = await workflow.execute_activity_method(
            SchedulerActivities.submit_job,
            job,
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            retry_policy=ACTIVITY_RETRY,
        )

    async def _cancel_job(self, reason: str) -> None:
        await workflow.execute_activity_method(
            SchedulerActivities.cancel_job,
            CancelJobInput(job_id=self._job_id, reason=reason),
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            retry_policy=ACTIVITY_RETRY,
        )
