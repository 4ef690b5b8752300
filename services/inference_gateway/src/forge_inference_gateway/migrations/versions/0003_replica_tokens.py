"""The bearer token issued for each replica added at run time.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("upstream_replicas") as batch:
        batch.add_column(sa.Column("token", sa.String(512), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("upstream_replicas") as batch:
        batch.drop_column("token")
