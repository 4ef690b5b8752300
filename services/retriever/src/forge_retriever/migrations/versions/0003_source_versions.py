"""Upstream versions of documents changed through the document-change topic.

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
    op.create_table(
        "source_versions",
        sa.Column("collection", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("document_id", sa.String(512), primary_key=True),
        sa.Column("producer", sa.String(255), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("applied_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("source_versions")
