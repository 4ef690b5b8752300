"""Retriever persistence: collections, documents and their chunks (the source of truth of the index)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow


class CollectionRow(Base):
    """A named set of documents; ``last_version`` numbers every change made in it."""

    __tablename__ = "collections"

    name: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    last_version: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class DocumentRow(Base):
    """A source document as last upserted; ``version`` is its collection's change number then.

    A document belongs to one tenant: the same id in the same collection is a different document
    for another tenant, so no tenant can overwrite, delete or read another's.
    """

    __tablename__ = "documents"

    collection: Mapped[str] = mapped_column(sa.ForeignKey("collections.name"), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    id: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    title: Mapped[str] = mapped_column(sa.Text, default="")
    text: Mapped[str] = mapped_column(sa.Text)
    # ``metadata`` is reserved on declarative classes; the column keeps the plain name.
    meta: Mapped[dict[str, str]] = mapped_column("metadata", sa.JSON, default=dict)
    version: Mapped[int] = mapped_column(sa.BigInteger)
    content_hash: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class ChunkRow(Base):
    """One chunk of a document; ``point_id`` is its id in the index, ``chunk_id`` the caller-facing one."""

    __tablename__ = "chunks"
    __table_args__ = (
        sa.ForeignKeyConstraint(
            ["collection", "tenant", "document_id"],
            ["documents.collection", "documents.tenant", "documents.id"],
            ondelete="CASCADE",
        ),
        sa.Index("ix_chunks_document", "collection", "tenant", "document_id"),
    )

    point_id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)
    collection: Mapped[str] = mapped_column(sa.String(128))
    tenant: Mapped[str] = mapped_column(sa.String(128))
    document_id: Mapped[str] = mapped_column(sa.String(512))
    chunk_index: Mapped[int] = mapped_column(sa.Integer)
    chunk_id: Mapped[str] = mapped_column(sa.String(600))
    text: Mapped[str] = mapped_column(sa.Text)
    start_char: Mapped[int] = mapped_column(sa.Integer)
    end_char: Mapped[int] = mapped_column(sa.Integer)


class SourceVersionRow(Base):
    """The newest upstream ``DocumentChanged`` version applied to a document (kept after a delete).

    Upstream events arrive at least once and, across partitions or a replay, out of order; one
    older than this is ignored, so a late update cannot resurrect or roll back a document. An
    unversioned change is judged by when it happened instead (``occurred_at``, the newest applied
    change's signed event time): an older one is a replay of an old genuine event.
    """

    __tablename__ = "source_versions"

    collection: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    document_id: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    producer: Mapped[str] = mapped_column(sa.String(255))
    version: Mapped[int] = mapped_column(sa.BigInteger)
    applied_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    occurred_at: Mapped[float | None] = mapped_column(sa.Float, nullable=True)


def chunks_with_documents(*columns: Any) -> sa.Select[Any]:
    """``columns`` of every chunk joined with its document (same collection, tenant and id)."""
    return sa.select(*columns).join(
        DocumentRow,
        sa.and_(
            DocumentRow.collection == ChunkRow.collection,
            DocumentRow.tenant == ChunkRow.tenant,
            DocumentRow.id == ChunkRow.document_id,
        ),
    )


def collection_counts(tenant: str | None) -> sa.Select[Any]:
    """(name, documents, chunks) of each collection holding ``tenant``'s documents, counting that
    tenant's only; ``tenant=None``: every collection, all tenants together."""
    docs_q = sa.select(DocumentRow.collection, sa.func.count().label("n"))
    chunks_q = sa.select(ChunkRow.collection, sa.func.count().label("n"))
    if tenant is not None:
        docs_q = docs_q.where(DocumentRow.tenant == tenant)
        chunks_q = chunks_q.where(ChunkRow.tenant == tenant)
    docs = docs_q.group_by(DocumentRow.collection).subquery()
    chunks = chunks_q.group_by(ChunkRow.collection).subquery()
    stmt = (
        sa.select(CollectionRow.name, docs.c.n, chunks.c.n)
        .outerjoin(docs, docs.c.collection == CollectionRow.name)
        .outerjoin(chunks, chunks.c.collection == CollectionRow.name)
        .order_by(CollectionRow.name)
    )
    if tenant is not None:
        # Another tenant's collection names are not this tenant's business.
        stmt = stmt.where(docs.c.n > 0)
    return stmt
