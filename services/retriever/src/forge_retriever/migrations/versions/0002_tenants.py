"""Documents and chunks belong to a tenant; existing rows go to the ``default`` tenant.

The tenant joins the documents' primary key, so the tables are rebuilt (SQLite cannot alter a
primary key): new tables are created beside the old ones, filled, and renamed over them.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

DEFAULT_TENANT = "default"
_DOC_COLUMNS = "collection, id, title, text, metadata, version, content_hash, created_at, updated_at"
_CHUNK_COLUMNS = "point_id, collection, document_id, chunk_index, chunk_id, text, start_char, end_char"


def _documents(name: str, *, tenant: bool) -> None:
    keys = [sa.Column("tenant", sa.String(128), primary_key=True)] if tenant else []
    op.create_table(
        name,
        sa.Column("collection", sa.String(128), sa.ForeignKey("collections.name"), primary_key=True),
        *keys,
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("title", sa.Text, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )


def _chunks(name: str, documents: str, *, tenant: bool) -> None:
    keys = ["collection", "tenant", "document_id"] if tenant else ["collection", "document_id"]
    op.create_table(
        name,
        sa.Column("point_id", sa.String(36), primary_key=True),
        sa.Column("collection", sa.String(128), nullable=False),
        *([sa.Column("tenant", sa.String(128), nullable=False)] if tenant else []),
        sa.Column("document_id", sa.String(512), nullable=False),
        sa.Column("chunk_index", sa.Integer, nullable=False),
        sa.Column("chunk_id", sa.String(600), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("start_char", sa.Integer, nullable=False),
        sa.Column("end_char", sa.Integer, nullable=False),
        sa.ForeignKeyConstraint(
            keys, [f"{documents}.{k}".replace("document_id", "id") for k in keys], ondelete="CASCADE"
        ),
    )


def upgrade() -> None:
    _documents("documents_v2", tenant=True)
    _chunks("chunks_v2", "documents_v2", tenant=True)
    op.execute(
        f"INSERT INTO documents_v2 (tenant, {_DOC_COLUMNS}) SELECT '{DEFAULT_TENANT}', {_DOC_COLUMNS} FROM documents"
    )
    op.execute(
        f"INSERT INTO chunks_v2 (tenant, {_CHUNK_COLUMNS}) SELECT '{DEFAULT_TENANT}', {_CHUNK_COLUMNS} FROM chunks"
    )
    op.drop_index("ix_chunks_document", "chunks")
    op.drop_table("chunks")
    op.drop_table("documents")
    op.rename_table("documents_v2", "documents")
    op.rename_table("chunks_v2", "chunks")
    op.create_index("ix_chunks_document", "chunks", ["collection", "tenant", "document_id"])


def downgrade() -> None:
    # Only the default tenant's documents fit the old key; the others are dropped with the column.
    _documents("documents_v1", tenant=False)
    _chunks("chunks_v1", "documents_v1", tenant=False)
    op.execute(
        f"INSERT INTO documents_v1 ({_DOC_COLUMNS}) SELECT {_DOC_COLUMNS} FROM documents"
        f" WHERE tenant = '{DEFAULT_TENANT}'"
    )
    op.execute(
        f"INSERT INTO chunks_v1 ({_CHUNK_COLUMNS}) SELECT {_CHUNK_COLUMNS} FROM chunks"
        f" WHERE tenant = '{DEFAULT_TENANT}'"
    )
    op.drop_index("ix_chunks_document", "chunks")
    op.drop_table("chunks")
    op.drop_table("documents")
    op.rename_table("documents_v1", "documents")
    op.rename_table("chunks_v1", "chunks")
    op.create_index("ix_chunks_document", "chunks", ["collection", "document_id"])
