"""Assignment driven by an index: a per-comparison answer count, and answered leases closed.

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
    with op.batch_alter_table("feedback_comparisons") as batch:
        batch.add_column(sa.Column("answer_count", sa.Integer, nullable=False, server_default="0"))
    op.execute(
        "UPDATE feedback_comparisons SET answer_count = (SELECT count(*) FROM feedback_preferences p"
        " WHERE p.comparison_id = feedback_comparisons.id)"
    )
    op.create_index(
        "ix_feedback_comparisons_answer_count_seq", "feedback_comparisons", ["answer_count", "seq"]
    )
    # From now on an answer ends its lease; do the same for the answers already recorded.
    op.execute(
        "UPDATE feedback_assignments SET expires_at = (SELECT p.created_at FROM feedback_preferences p"
        " WHERE p.comparison_id = feedback_assignments.comparison_id"
        " AND p.rater_id = feedback_assignments.rater_id)"
        " WHERE EXISTS (SELECT 1 FROM feedback_preferences p"
        " WHERE p.comparison_id = feedback_assignments.comparison_id"
        " AND p.rater_id = feedback_assignments.rater_id AND p.created_at < feedback_assignments.expires_at)"
    )


def downgrade() -> None:
    op.drop_index("ix_feedback_comparisons_answer_count_seq", table_name="feedback_comparisons")
    with op.batch_alter_table("feedback_comparisons") as batch:
        batch.drop_column("answer_count")
