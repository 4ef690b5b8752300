"""Tenants' documents on the public API: uploaded files, vector stores and what each holds.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rag_files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.Integer, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_rag_files_tenant_id", "rag_files", ["tenant_id"])
    op.create_table(
        "vector_stores",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("metadata_json", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_vector_stores_tenant_id", "vector_stores", ["tenant_id"])
    op.create_table(
        "vector_store_items",
        sa.Column("store_id", sa.String(40), sa.ForeignKey("vector_stores.id"), primary_key=True),
        sa.Column("document_id", sa.String(512), primary_key=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("title", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(32), nullable=False),
        sa.Column("error_message", sa.Text, nullable=False),
        sa.Column("attributes_json", sa.Text, nullable=False),
        sa.Column("usage_bytes", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_vector_store_items_tenant_id", "vector_store_items", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_vector_store_items_tenant_id", "vector_store_items")
    op.drop_table("vector_store_items")
    op.drop_index("ix_vector_stores_tenant_id", "vector_stores")
    op.drop_table("vector_stores")
    op.drop_index("ix_rag_files_tenant_id", "rag_files")
    op.drop_table("rag_files")
