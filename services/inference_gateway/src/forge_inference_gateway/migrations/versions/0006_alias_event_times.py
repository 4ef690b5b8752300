"""When the registry made the change that set an alias's stable model and its canary split, so
that events of different stages arriving out of order do not undo a later decision.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_aliases") as batch:
        batch.add_column(sa.Column("source_at_ns", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("canary_at_ns", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("model_aliases") as batch:
        batch.drop_column("canary_at_ns")
        batch.drop_column("source_at_ns")
