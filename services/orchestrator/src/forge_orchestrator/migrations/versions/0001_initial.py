"""Job events routed to workflows, and the kit tables.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from forge_kit.migration_ops import create_kit_tables, drop_kit_tables

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_events",
        sa.Column("event_id", sa.String(64), primary_key=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("workflow_id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("received_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])
    op.create_index("ix_job_events_workflow_id", "job_events", ["workflow_id"])
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_index("ix_job_events_workflow_id", "job_events")
    op.drop_index("ix_job_events_job_id", "job_events")
    op.drop_table("job_events")
