"""Tenants' opt-in to training on their prompts (off by default) and the recorded prompts.

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
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("allow_training", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_table(
        "training_prompts",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("prompt_hash", sa.String(64), nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("tenant_id", "prompt_hash", name="uq_training_prompts_tenant_hash"),
    )
    op.create_index("ix_training_prompts_tenant_id", "training_prompts", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_training_prompts_tenant_id", "training_prompts")
    op.drop_table("training_prompts")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("allow_training")
