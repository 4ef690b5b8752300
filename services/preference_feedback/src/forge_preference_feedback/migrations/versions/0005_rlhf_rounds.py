"""RLHF rounds: what the orchestrator's RLHF workflow reports about each round, for the admin page.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "feedback_rlhf_rounds",
        sa.Column("workflow_id", sa.String(128), primary_key=True),
        sa.Column("round", sa.Integer, primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("step", sa.String(255), nullable=False, server_default=""),
        sa.Column("snapshot_id", sa.String(128), nullable=False, server_default=""),
        sa.Column("reward_model", sa.String(200), nullable=False, server_default=""),
        sa.Column("policy_uri", sa.Text, nullable=False, server_default=""),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_feedback_rlhf_rounds_updated_at", "feedback_rlhf_rounds", ["updated_at"])


def downgrade() -> None:
    op.drop_index("ix_feedback_rlhf_rounds_updated_at", "feedback_rlhf_rounds")
    op.drop_table("feedback_rlhf_rounds")
