"""Job isolation: whether an admin submitted a job, and how each node's agent contains jobs.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("submitted_by_admin", sa.Boolean, nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("job_isolation", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("job_isolation")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("submitted_by_admin")
