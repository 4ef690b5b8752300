"""Reward-model registry: training snapshot, backbone, held-out accuracy with its interval, who
registered a version and who last changed its status.

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
    with op.batch_alter_table("feedback_reward_models") as batch:
        # Versions registered before this revision have no snapshot or backbone on record ("")
        # and no held-out figures (NULL): nothing is made up for them.
        batch.add_column(sa.Column("snapshot_id", sa.String(128), nullable=False, server_default=""))
        batch.add_column(sa.Column("backbone", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("heldout_accuracy", sa.Float, nullable=True))
        batch.add_column(sa.Column("heldout_ci95_low", sa.Float, nullable=True))
        batch.add_column(sa.Column("heldout_ci95_high", sa.Float, nullable=True))
        batch.add_column(sa.Column("heldout_n", sa.Integer, nullable=True))
        batch.add_column(sa.Column("heldout_interval", sa.String(16), nullable=False, server_default=""))
        batch.add_column(sa.Column("registered_by", sa.String(128), nullable=False, server_default=""))
        batch.add_column(sa.Column("status_changed_at", sa.DateTime, nullable=True))
        batch.add_column(sa.Column("status_changed_by", sa.String(128), nullable=False, server_default=""))
        batch.create_index("ix_feedback_reward_models_status", ["status"])


def downgrade() -> None:
    with op.batch_alter_table("feedback_reward_models") as batch:
        batch.drop_index("ix_feedback_reward_models_status")
        for column in (
            "status_changed_by",
            "status_changed_at",
            "registered_by",
            "heldout_interval",
            "heldout_n",
            "heldout_ci95_high",
            "heldout_ci95_low",
            "heldout_accuracy",
            "backbone",
            "snapshot_id",
        ):
            batch.drop_column(column)
