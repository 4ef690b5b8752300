"""Canary split on model aliases; model-server replicas added at run time.

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
    with op.batch_alter_table("model_aliases") as batch:
        batch.add_column(sa.Column("canary_model_name", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("canary_model_version", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("canary_weight", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "upstream_replicas",
        sa.Column("url", sa.String(512), primary_key=True),
        sa.Column("added_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("upstream_replicas")
    with op.batch_alter_table("model_aliases") as batch:
        batch.drop_column("canary_weight")
        batch.drop_column("canary_model_version")
        batch.drop_column("canary_model_name")
