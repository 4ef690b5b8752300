"""Watermarks of the catch-up from producers' outboxes.

Revision ID: 0002
Revises: 0001
"""

from forge_kit.migration_ops import create_catchup_table, drop_catchup_table

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_catchup_table()


def downgrade() -> None:
    drop_catchup_table()
