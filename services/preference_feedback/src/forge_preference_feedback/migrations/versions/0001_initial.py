"""Comparisons, assignments, preferences, reward models and the kit tables.

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
        "feedback_comparisons",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False, unique=True),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("source_key", sa.String(255), nullable=False, unique=True),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("response_a_id", sa.String(40), nullable=False),
        sa.Column("response_a_text", sa.Text, nullable=False),
        sa.Column("response_a_model", sa.String(255), nullable=False),
        sa.Column("response_b_id", sa.String(40), nullable=False),
        sa.Column("response_b_text", sa.Text, nullable=False),
        sa.Column("response_b_model", sa.String(255), nullable=False),
        sa.Column("gold_choice", sa.String(1), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "feedback_assignments",
        sa.Column("comparison_id", sa.String(40), sa.ForeignKey("feedback_comparisons.id"), primary_key=True),
        sa.Column("rater_id", sa.String(128), primary_key=True),
        sa.Column("assigned_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_feedback_assignments_expires_at", "feedback_assignments", ["expires_at"])
    op.create_table(
        "feedback_preferences",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("comparison_id", sa.String(40), sa.ForeignKey("feedback_comparisons.id"), nullable=False),
        sa.Column("rater_id", sa.String(128), nullable=False),
        sa.Column("choice", sa.Integer, nullable=False),
        sa.Column("confidence", sa.Float, nullable=False),
        sa.Column("rationale", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("comparison_id", "rater_id", name="uq_feedback_preferences_comparison_rater"),
    )
    op.create_index("ix_feedback_preferences_comparison_id", "feedback_preferences", ["comparison_id"])
    op.create_index("ix_feedback_preferences_rater_id", "feedback_preferences", ["rater_id"])
    op.create_table(
        "feedback_reward_models",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_feedback_reward_models_created_at", "feedback_reward_models", ["created_at"])
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_table("feedback_reward_models")
    op.drop_table("feedback_preferences")
    op.drop_table("feedback_assignments")
    op.drop_table("feedback_comparisons")
