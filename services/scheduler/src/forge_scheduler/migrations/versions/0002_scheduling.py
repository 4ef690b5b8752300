"""Scheduling state: placements, attempts, preemption bookkeeping, cohorts, usage, team tokens.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("teams") as batch:
        batch.add_column(sa.Column("cohort", sa.String(63), nullable=False, server_default="default"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("placement", sa.String(16), nullable=False, server_default="any"))
        batch.add_column(sa.Column("min_runtime_s", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("checkpointable", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("checkpoint_interval_s", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("attempt", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("queued_at", sa.DateTime, nullable=True))
        batch.add_column(sa.Column("slots", sa.JSON, nullable=True))
        batch.add_column(sa.Column("replica_states", sa.JSON, nullable=True))
        batch.add_column(sa.Column("draining", sa.JSON, nullable=True))
        batch.add_column(sa.Column("borrowed", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("attained_gpu_s", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_checkpoint_at", sa.DateTime, nullable=True))
        batch.add_column(sa.Column("preempt_by", sa.DateTime, nullable=True))
        batch.add_column(sa.Column("pending_reason", sa.Text, nullable=False, server_default=""))
        batch.add_column(sa.Column("estimated_start", sa.DateTime, nullable=True))
    op.create_table(
        "team_usage",
        sa.Column("team", sa.String(63), primary_key=True),
        sa.Column("decayed_gpu_s", sa.Float, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "team_tokens",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("team", sa.String(63), sa.ForeignKey("teams.name", ondelete="CASCADE"), index=True),
        sa.Column("description", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("team_tokens")
    op.drop_table("team_usage")
    with op.batch_alter_table("jobs") as batch:
        for name in (
            "estimated_start",
            "pending_reason",
            "preempt_by",
            "last_checkpoint_at",
            "attained_gpu_s",
            "borrowed",
            "draining",
            "replica_states",
            "slots",
            "queued_at",
            "attempt",
            "checkpoint_interval_s",
            "checkpointable",
            "min_runtime_s",
            "placement",
        ):
            batch.drop_column(name)
    with op.batch_alter_table("teams") as batch:
        batch.drop_column("cohort")
