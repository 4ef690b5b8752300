"""Where a comparison comes from (``seed``, ``policy``, ``shadow``) and the batch it was queued in.

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
    with op.batch_alter_table("feedback_comparisons") as batch:
        batch.add_column(sa.Column("origin", sa.String(16), nullable=False, server_default="seed"))
        batch.add_column(sa.Column("batch", sa.String(128), nullable=False, server_default=""))
        batch.create_index("ix_feedback_comparisons_batch", ["batch"])


def downgrade() -> None:
    with op.batch_alter_table("feedback_comparisons") as batch:
        batch.drop_index("ix_feedback_comparisons_batch")
        batch.drop_column("batch")
        batch.drop_column("origin")
