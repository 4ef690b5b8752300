"""Shadow mode: an alias's shadow model and share, and the stored (production, shadow) answer pairs.

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
    with op.batch_alter_table("model_aliases") as batch:
        batch.add_column(sa.Column("shadow_model_name", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("shadow_model_version", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("shadow_percent", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "shadow_pairs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("alias", sa.String(255), nullable=False, index=True),
        sa.Column("path", sa.String(64), nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("production_model", sa.String(255), nullable=False),
        sa.Column("production_status", sa.Integer, nullable=False),
        sa.Column("production_answer", sa.Text, nullable=False),
        sa.Column("shadow_model", sa.String(255), nullable=False),
        sa.Column("shadow_status", sa.String(16), nullable=False),
        sa.Column("shadow_answer", sa.Text, nullable=False),
        sa.Column("shadow_ms", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("shadow_pairs")
    with op.batch_alter_table("model_aliases") as batch:
        batch.drop_column("shadow_percent")
        batch.drop_column("shadow_model_version")
        batch.drop_column("shadow_model_name")
