from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from builders import make_job
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_scheduler.messages import spec_from_proto
from forge_scheduler.records import NodeRegistration, QuotaSpec
from forge_scheduler.service import SchedulerService

pytestmark = pytest.mark.asyncio
H100 = QuotaSpec(gpu_type="H100", guaranteed_gpus=8, borrow_limit=8, weight=1)


async def test_submit_queues_job_and_stages_event(service: SchedulerService, db: Database) -> None:
    await service.teams.create_team("research", "Research", [H100])
    job = await service.submit_job(make_job().gpus(8).label("workflow_id", "wf-1").record())
    assert job.state == common_pb2.JOB_STATE_PENDING
    async with db.session() as session:
        rows = (await session.scalars(sa.select(OutboxEvent))).all()
    assert len(rows) == 1
    event = events_pb2.JobStateChanged.FromString(rows[0].payload)
    assert (event.job_id, event.state, event.labels["workflow_id"]) == (
        job.id,
        common_pb2.JOB_STATE_PENDING,
        "wf-1",
    )
    assert event.meta.producer == "scheduler" and event.meta.sequence == rows[0].sequence


async def test_submit_is_idempotent_on_request_id(service: SchedulerService) -> None:
    await service.teams.create_team("research", "", [])
    first = await service.submit_job(make_job().record(), request_id="r-1")
    second = await service.submit_job(make_job().record(), request_id="r-1")
    assert first.id == second.id
    _jobs, total = await service.list_jobs("research", [], 10, 0)
    assert total == 1


@pytest.mark.parametrize(
    ("builder", "field"),
    [
        (make_job(team=""), "spec.team"),
        (make_job(name="Bad_Name"), "spec.name"),
        (make_job().priority("urgent"), "spec.priority_class"),
        (make_job().gpus(8, gpu_type=""), "spec.resources.gpu_type"),
    ],
)
async def test_invalid_spec_names_the_field_and_writes_nothing(
    service: SchedulerService, db: Database, builder, field: str
) -> None:  # type: ignore[no-untyped-def]
    await service.teams.create_team("research", "", [])
    with pytest.raises(errors.ValidationError) as caught:
        await service.submit_job(builder.record())
    assert caught.value.field == field
    _jobs, total = await service.list_jobs("", [], 10, 0)
    assert total == 0


async def test_unknown_team_is_not_found(service: SchedulerService) -> None:
    with pytest.raises(errors.NotFoundError, match="team 'nobody' not found"):
        await service.submit_job(make_job(team="nobody").record())


async def test_cancel_is_terminal_and_idempotent(service: SchedulerService, db: Database) -> None:
    await service.teams.create_team("research", "", [])
    job = await service.submit_job(make_job().record())
    cancelled = await service.cancel_job(job.id, "not needed")
    again = await service.cancel_job(job.id, "twice")
    assert cancelled.state == again.state == common_pb2.JOB_STATE_CANCELLED
    assert again.message == "not needed"
    async with db.session() as session:
        count = await session.scalar(sa.select(sa.func.count()).select_from(OutboxEvent))
    assert count == 2


async def test_teams_and_quotas(service: SchedulerService) -> None:
    await service.teams.create_team("research", "Research", [H100])
    with pytest.raises(errors.AlreadyExistsError):
        await service.teams.create_team("research", "", [])
    team = await service.teams.set_quota("research", QuotaSpec(gpu_type="H100", guaranteed_gpus=16, weight=2))
    assert [(q.gpu_type, q.guaranteed_gpus, q.weight) for q in team.quotas] == [("H100", 16, 2.0)]
    with pytest.raises(errors.NotFoundError):
        await service.teams.set_quota("nobody", H100)


async def test_watch_sends_initial_state_then_changes(service: SchedulerService) -> None:
    await service.teams.create_team("research", "", [])
    job = await service.submit_job(make_job().record())
    stream = service.watches.watch("research", [], send_initial=True)
    first = await anext(stream)
    assert first.id == job.id and first.state == common_pb2.JOB_STATE_PENDING
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    await service.cancel_job(job.id, "stop")
    changed = await asyncio.wait_for(pending, 30)
    assert changed.state == common_pb2.JOB_STATE_CANCELLED
    await stream.aclose()


async def test_slow_watcher_is_dropped_not_buffered_forever(db: Database) -> None:
    service = SchedulerService(db, watch_queue_size=2)
    await service.teams.create_team("research", "", [])
    stream = service.watches.watch("research", [], send_initial=False)
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    for _ in range(5):
        await service.submit_job(make_job().record())
    await waiting
    with pytest.raises(errors.OverloadedError):
        for _ in range(5):
            await anext(stream)


async def test_the_collaborators_wake_the_loop_set_after_them_and_commits_reach_on_commit(
    db: Database,
) -> None:
    """A quota set and a node registered may let a job start: they call the wake the scheduling
    loop sets (after the service and its collaborators were built); every committed job change
    calls ``on_commit``."""
    commits: list[int] = []
    service = SchedulerService(db, on_commit=lambda: commits.append(1))
    wakes: list[str] = []
    await service.teams.create_team("research", "", [])
    service.on_change(lambda: wakes.append("first"))
    await service.teams.set_quota("research", H100)
    service.on_change(lambda: wakes.append("second"))
    await service.nodes.register_node(NodeRegistration(node_name="node-a"))
    assert wakes == ["first", "second"]
    job = await service.submit_job(make_job().record())
    await service.cancel_job(job.id, "not needed")
    assert len(commits) == 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kind": scheduler_pb2.JOB_KIND_TRAINING}, "spec.resources.gpu_count"),
        ({"name": ""}, "spec.name"),
        ({"max_runtime_seconds": 10**9}, "spec.max_runtime_seconds"),
        ({"min_runtime_seconds": 600, "max_runtime_seconds": 60}, "spec.min_runtime_seconds"),
        ({"placement": 9}, "spec.placement"),
    ],
)
async def test_bad_specs_name_the_field_and_write_nothing(
    service: SchedulerService, db: Database, change: dict[str, object], field: str
) -> None:
    await service.teams.create_team("research", "", [])
    spec = make_job().build()
    for key, value in change.items():
        setattr(spec, key, value)
    with pytest.raises(errors.ValidationError) as caught:
        await service.submit_job(spec_from_proto(spec))
    assert caught.value.field == field
    async with db.session() as session:
        assert await session.scalar(sa.select(sa.func.count()).select_from(OutboxEvent)) == 0
