"""Whether a job's checkpoints start eval-and-promote (the job's ``auto_eval`` label).

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
    with op.batch_alter_table("job_events") as batch:
        batch.add_column(sa.Column("auto_eval", sa.Boolean, nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("job_events") as batch:
        batch.drop_column("auto_eval")
