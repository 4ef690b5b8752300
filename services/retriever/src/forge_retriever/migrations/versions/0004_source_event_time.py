"""When the newest applied upstream change happened (its signed ``meta.occurred_at``): an
unversioned change older than it is a replay and is ignored.

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
    with op.batch_alter_table("source_versions") as batch:
        batch.add_column(sa.Column("occurred_at", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("source_versions") as batch:
        batch.drop_column("occurred_at")
