"""Replay of a recorded smoke-workflow history against the current workflow code.

The history was recorded on the Temporal dev server by ``test_smoke_workflow_end_to_end`` (run it
with ``FORGE_RECORD_HISTORIES=1`` to re-record after an intended change guarded by
``workflow.patched``). A change that would make running workflows diverge fails here.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner
from temporalio.workflow import NondeterminismError

from forge_orchestrator.activities import CancelJobInput, SchedulerActivities
from forge_orchestrator.service import WORKFLOWS
from forge_orchestrator.smoke.model import SmokeInput, SmokeResult
from forge_orchestrator.smoke.workflow import SmokeWorkflow


def _history(histories_dir: Path) -> WorkflowHistory:
    data = json.loads((histories_dir / "smoke.json").read_text())
    return WorkflowHistory.from_json("smoke-recorded", data)


async def test_recorded_smoke_history_replays(histories_dir: Path) -> None:
    history = _history(histories_dir)
    assert len(history.events) > 20  # a full run: three activities, two signals, completion

    result = await Replayer(workflows=list(WORKFLOWS)).replay_workflow(history)

    assert result.replay_failure is None


@workflow.defn(name="smoke")
class _ReorderedSmoke(SmokeWorkflow):
    """What a careless edit looks like: cancelling before ever submitting."""

    @workflow.run
    async def run(self, params: SmokeInput) -> SmokeResult:
        await workflow.execute_activity_method(
            SchedulerActivities.cancel_job,
            CancelJobInput(job_id="job-x", reason="reordered"),
            start_to_close_timeout=timedelta(seconds=5),
        )
        return SmokeResult(job_id="job-x")


async def test_an_incompatible_change_fails_replay(histories_dir: Path) -> None:
    replayer = Replayer(workflows=[_ReorderedSmoke], workflow_runner=UnsandboxedWorkflowRunner())
    with pytest.raises(NondeterminismError):
        await replayer.replay_workflow(_history(histories_dir))
