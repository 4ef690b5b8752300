"""Teams, quotas, jobs, nodes and the kit tables.

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
        "teams",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("display_name", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "quotas",
        sa.Column("team", sa.String(63), sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("gpu_type", sa.String(63), primary_key=True),
        sa.Column("guaranteed_gpus", sa.Integer, nullable=False),
        sa.Column("borrow_limit", sa.Integer, nullable=False),
        sa.Column("weight", sa.Float, nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("request_id", sa.String(128), nullable=True, unique=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("team", sa.String(63), sa.ForeignKey("teams.name"), nullable=False),
        sa.Column("priority_class", sa.String(32), nullable=False),
        sa.Column("gpu_type", sa.String(63), nullable=False),
        sa.Column("gpus_per_replica", sa.Integer, nullable=False),
        sa.Column("replicas", sa.Integer, nullable=False),
        sa.Column("spec", sa.LargeBinary, nullable=False),
        sa.Column("state", sa.Integer, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("assigned_nodes", sa.JSON, nullable=False),
        sa.Column("preemption_count", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=True),
        sa.Column("finished_at", sa.DateTime, nullable=True),
    )
    op.create_index("ix_jobs_team", "jobs", ["team"])
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("gpus", sa.JSON, nullable=False),
        sa.Column("node_group", sa.String(255), nullable=False),
        sa.Column("rack", sa.String(255), nullable=False),
        sa.Column("nvlink_domain", sa.String(255), nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("state", sa.Integer, nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime, nullable=True),
        sa.Column("running_job_ids", sa.JSON, nullable=False),
    )
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_table("nodes")
    op.drop_table("jobs")
    op.drop_table("quotas")
    op.drop_table("teams")
