"""The stable model an alias named before its current one, which the gateway keeps routing to
while no replica serves the new one yet.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_aliases") as batch:
        batch.add_column(sa.Column("previous_model_name", sa.String(255), nullable=False, server_default=""))
        batch.add_column(
            sa.Column("previous_model_version", sa.String(255), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("model_aliases") as batch:
        batch.drop_column("previous_model_version")
        batch.drop_column("previous_model_name")
