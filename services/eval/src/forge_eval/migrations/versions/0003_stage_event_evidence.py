"""A stage event's evidence: a guarded canary's decision with the analysis behind it (JSON).

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
    with op.batch_alter_table("eval_stage_events") as batch:
        batch.add_column(sa.Column("evidence", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("eval_stage_events") as batch:
        batch.drop_column("evidence")
