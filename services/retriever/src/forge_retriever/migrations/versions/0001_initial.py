"""Collections, documents, chunks and the kit tables.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from forge_kit.migration_ops import create_kit_tables, drop_kit_tables

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "collections",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("last_version", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "documents",
        sa.Column("collection", sa.String(128), sa.ForeignKey("collections.name"), primary_key=True),
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("title", sa.Text, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "chunks",
        sa.Column("point_id", sa.String(36), primary_key=True),
        sa.Column("collection", sa.String(128), nullable=False),
        sa.Column("document_id", sa.String(512), nullable=False),
        sa.Column("chunk_index", sa.Integer, nullable=False),
        sa.Column("chunk_id", sa.String(600), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("start_char", sa.Integer, nullable=False),
        sa.Column("end_char", sa.Integer, nullable=False),
        sa.ForeignKeyConstraint(
            ["collection", "document_id"], ["documents.collection", "documents.id"], ondelete="CASCADE"
        ),
    )
    op.create_index("ix_chunks_document", "chunks", ["collection", "document_id"])
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_index("ix_chunks_document", "chunks")
    op.drop_table("chunks")
    op.drop_table("documents")
    op.drop_table("collections")
