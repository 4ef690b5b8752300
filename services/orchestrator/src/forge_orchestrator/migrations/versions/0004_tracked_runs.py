"""The MLflow run of each tracked training job.

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
    op.create_table(
        "tracked_runs",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=False),
        sa.Column("training_run_id", sa.String(255), nullable=False, server_default=""),
        sa.Column("final_state", sa.String(32), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_tracked_runs_training_run_id", "tracked_runs", ["training_run_id"])


def downgrade() -> None:
    op.drop_index("ix_tracked_runs_training_run_id", "tracked_runs")
    op.drop_table("tracked_runs")
