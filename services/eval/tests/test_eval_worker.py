"""The run worker: it re-queues what a previous process left running, and when it stops it waits
for the runs it cancels."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forge_eval.runs import RunService
from forge_eval.store.runs import RunStatus
from forge_kit.testing import eventually

pytestmark = pytest.mark.asyncio


async def test_worker_recovers_runs_left_running(runs: RunService, runner: Any) -> None:
    runner.scores["1"] = [1.0]
    run = await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=1, seed=0, options={})
    assert await runs.claim_next_run() == run.id
    assert await runs.claim_next_run() is None  # claimed runs are not handed out twice
    worker = asyncio.create_task(runs.run_worker())  # a new process: the RUNNING run is re-queued

    async def succeeded() -> bool:
        return (await runs.get_run(run.id))[0].status == RunStatus.SUCCEEDED

    try:
        await eventually(succeeded, interval_s=0.01, what="the re-queued run to succeed")
    finally:
        worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    assert (await runs.get_run(run.id))[0].status == RunStatus.SUCCEEDED


async def test_stopping_the_worker_waits_for_the_runs_it_cancels(runs: RunService, runner: Any) -> None:
    """A cancelled run unwinds (its session hands the connection back) before the worker returns:
    a run still unwinding after it would be cancelled again at loop shutdown, mid-close."""
    started, unwound = asyncio.Event(), asyncio.Event()

    async def blocking_run(spec: Any, endpoint: str, *, token: str | None = None) -> list[Any]:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.05)  # as a session's connection handed back to the pool
            unwound.set()
        return []

    runner.run = blocking_run
    await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=1, seed=0, options={})
    worker = asyncio.create_task(runs.run_worker())
    await asyncio.wait_for(started.wait(), timeout=30)
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    assert unwound.is_set()
