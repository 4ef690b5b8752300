"""A job's spec is stored as the domain's typed record (JSON), no longer as the serialised
``forge.scheduler.v1.JobSpec``: the scheduling loop read every pending job's bytes back into a
message each cycle. Existing rows are converted one by one, field for field; the downgrade writes
the message back.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op
from forge.scheduler.v1 import scheduler_pb2

from forge_scheduler.jobspec import JobSpec
from forge_scheduler.messages import spec_from_proto, spec_to_proto

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _jobs(spec_type: sa.types.TypeEngine, record_type: sa.types.TypeEngine) -> sa.TableClause:
    return sa.table(
        "jobs", sa.column("id", sa.String), sa.column("spec", spec_type), sa.column("converted", record_type)
    )


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("converted", sa.JSON, nullable=True))
    jobs = _jobs(sa.LargeBinary(), sa.JSON())
    bind = op.get_bind()
    for job_id, blob in bind.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        message = scheduler_pb2.JobSpec.FromString(blob)
        if message.kind not in scheduler_pb2.JobKind.values():
            message.kind = scheduler_pb2.JOB_KIND_UNSPECIFIED  # never validated before this record
        bind.execute(
            jobs.update().where(jobs.c.id == job_id).values(converted=spec_from_proto(message).to_json())
        )
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("spec")
        batch.alter_column("converted", new_column_name="spec", existing_type=sa.JSON, nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("converted", sa.LargeBinary, nullable=True))
    jobs = _jobs(sa.JSON(), sa.LargeBinary())
    bind = op.get_bind()
    for job_id, record in bind.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        blob = spec_to_proto(JobSpec.from_json(record)).SerializeToString()
        bind.execute(jobs.update().where(jobs.c.id == job_id).values(converted=blob))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("spec")
        batch.alter_column("converted", new_column_name="spec", existing_type=sa.LargeBinary, nullable=False)
