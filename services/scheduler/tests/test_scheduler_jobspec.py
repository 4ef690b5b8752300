"""The job spec as the domain's typed record: built once from the API's message, stored as JSON,
answered as the same message; rows stored before the record existed are converted by migration
0006 (and back by its downgrade)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from builders import make_job
from conftest import MIGRATIONS
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2
from sqlalchemy.engine import Connection

from forge_kit import errors
from forge_kit.db import Database
from forge_scheduler.jobspec import JobKind, JobSpec
from forge_scheduler.messages import spec_from_proto, spec_to_proto
from forge_scheduler.policy import Placement
from forge_scheduler.service import SchedulerService
from forge_scheduler.store import JobRow


def full_message() -> scheduler_pb2.JobSpec:
    """Every field of JobSpec set to a value other than its default."""
    return scheduler_pb2.JobSpec(
        name="pretrain",
        team="research",
        priority_class="high",
        kind=scheduler_pb2.JOB_KIND_FINE_TUNE,
        resources=common_pb2.ResourceRequest(gpu_count=4, gpu_type="H100", cpu_millis=8000, memory_mb=65536),
        replicas=2,
        same_node_group=True,
        command=["python", "-m", "forge_training.run"],
        env={"A": "1"},
        image="forge/trainer:1",
        max_runtime_seconds=3600,
        preemptible=True,
        labels={"workflow_id": "wf-1"},
        placement=scheduler_pb2.PLACEMENT_SAME_NODE,
        min_runtime_seconds=60,
        checkpointable=True,
        checkpoint_interval_seconds=300,
        routing=common_pb2.JobRouting(workflow_id="wf-1", skip_auto_eval=True),
    )


def test_every_field_of_the_message_survives_the_record_and_its_json() -> None:
    message = full_message()
    # A field added to JobSpec fails here until full_message sets it and the record carries it.
    assert len(message.ListFields()) == len(scheduler_pb2.JobSpec.DESCRIPTOR.fields)
    record = spec_from_proto(message)
    assert (record.kind, record.placement, record.tasks) == (JobKind.FINE_TUNE, Placement.SAME_NODE, 2)
    assert JobSpec.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert spec_to_proto(record) == message
    assert spec_to_proto(spec_from_proto(make_job().build())) == make_job().build()  # unset stays unset


@pytest.mark.parametrize(
    ("change", "field"), [({"kind": 42}, "spec.kind"), ({"placement": 9}, "spec.placement")]
)
def test_a_value_the_api_does_not_define_is_refused_at_the_edge(change: dict[str, int], field: str) -> None:
    message = make_job().build()
    for key, value in change.items():
        setattr(message, key, value)
    with pytest.raises(errors.ValidationError) as caught:
        spec_from_proto(message)
    assert caught.value.field == field


def _alembic(to: str, *, down: bool = False):  # type: ignore[no-untyped-def]
    def run(connection: Connection) -> None:
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, to)

    return run


async def test_migration_0006_converts_stored_specs_both_ways(
    service: SchedulerService, db: Database
) -> None:
    await _convert_both_ways(service, db)


@pytest.mark.integration
async def test_migration_0006_on_postgresql(postgres_url: str) -> None:
    db = Database(postgres_url)
    try:
        await db.migrate(MIGRATIONS)
        await _convert_both_ways(SchedulerService(db), db)
    finally:
        await db.dispose()


async def _convert_both_ways(service: SchedulerService, db: Database) -> None:
    await service.teams.create_team("research", "", [])
    message = full_message()
    message.placement = scheduler_pb2.PLACEMENT_ANY  # gpus 4 x 2 replicas on one node may not fit anywhere
    job = await service.submit_job(spec_from_proto(message))

    async with db.engine.begin() as connection:
        await connection.run_sync(_alembic("0005", down=True))
        blob = (
            await connection.execute(sa.text("SELECT spec FROM jobs WHERE id = :id"), {"id": job.id})
        ).scalar_one()
    assert scheduler_pb2.JobSpec.FromString(blob) == message

    async with db.engine.begin() as connection:
        await connection.run_sync(_alembic("head"))
    async with db.session() as session:
        row = await session.get(JobRow, job.id)
        assert row is not None and row.job_spec == spec_from_proto(message)
    assert (await service.get_job(job.id)).job_spec.routing is not None
