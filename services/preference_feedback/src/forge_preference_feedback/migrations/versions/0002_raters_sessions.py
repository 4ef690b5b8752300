"""Rater accounts and sessions; preference timing and UI version; reward-model status.

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
    op.create_table(
        "feedback_raters",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("password_hash", sa.String(255), nullable=False),
        sa.Column("is_admin", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "feedback_sessions",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("rater_id", sa.String(128), sa.ForeignKey("feedback_raters.id"), nullable=False),
        sa.Column("csrf_token", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_feedback_sessions_rater_id", "feedback_sessions", ["rater_id"])
    op.create_index("ix_feedback_sessions_expires_at", "feedback_sessions", ["expires_at"])
    with op.batch_alter_table("feedback_preferences") as batch:
        batch.add_column(sa.Column("shown_at", sa.DateTime, nullable=True))
        batch.add_column(sa.Column("ui_version", sa.String(32), nullable=False, server_default=""))
    with op.batch_alter_table("feedback_reward_models") as batch:
        batch.add_column(sa.Column("status", sa.String(16), nullable=False, server_default="candidate"))


def downgrade() -> None:
    with op.batch_alter_table("feedback_reward_models") as batch:
        batch.drop_column("status")
    with op.batch_alter_table("feedback_preferences") as batch:
        batch.drop_column("ui_version")
        batch.drop_column("shown_at")
    op.drop_table("feedback_sessions")
    op.drop_table("feedback_raters")
