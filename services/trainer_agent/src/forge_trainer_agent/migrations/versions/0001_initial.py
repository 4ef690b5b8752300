"""Runs of job replicas on this node, and the kit tables.

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
        "runs",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.String(40), nullable=False),
        sa.Column("state", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("reported_version", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("command", sa.JSON, nullable=False),
        sa.Column("gpu_indices", sa.JSON, nullable=False),
        sa.Column("node_rank", sa.Integer, nullable=False),
        sa.Column("num_nodes", sa.Integer, nullable=False),
        sa.Column("log_path", sa.Text, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("last_checkpoint_uri", sa.Text, nullable=False),
        sa.Column("last_checkpoint_step", sa.BigInteger, nullable=False),
        sa.Column("last_checkpoint_at", sa.DateTime, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=True),
        sa.Column("finished_at", sa.DateTime, nullable=True),
    )
    op.create_index("ix_runs_run_id", "runs", ["run_id"])
    op.create_index("ix_runs_state", "runs", ["state"])
    op.create_index("ix_runs_created_at", "runs", ["created_at"])
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_index("ix_runs_created_at", "runs")
    op.drop_index("ix_runs_state", "runs")
    op.drop_index("ix_runs_run_id", "runs")
    op.drop_table("runs")
