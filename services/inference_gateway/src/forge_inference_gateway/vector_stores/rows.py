"""Tables of a tenant's documents on the public API (``service.py``): uploaded files, vector
stores (one retriever collection each, named by the store's id, in the tenant's namespace) and
what each store holds with its indexing status.

The retriever holds the text that is searched; these rows hold what the OpenAI Files and Vector
Stores API reports (names, sizes, statuses, attributes) and the file bytes until deleted."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow


class RagFileRow(Base):
    """An uploaded file (``POST /v1/files``): its bytes, kept until the tenant deletes it."""

    __tablename__ = "rag_files"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    filename: Mapped[str] = mapped_column(sa.String(255))
    purpose: Mapped[str] = mapped_column(sa.String(32))
    size: Mapped[int] = mapped_column("bytes", sa.Integer)
    content: Mapped[bytes] = mapped_column(sa.LargeBinary)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class VectorStoreRow(Base):
    """A tenant's vector store; its retriever collection is named by ``id``."""

    __tablename__ = "vector_stores"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(sa.String(255), default="")
    metadata_json: Mapped[str] = mapped_column(sa.Text, default="{}")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class VectorStoreItemRow(Base):
    """One document of a store: an attached file (``document_id`` is the file's id) or a document
    upserted by id; ``status`` is ``in_progress``, ``completed`` or ``failed`` (with the reason)."""

    __tablename__ = "vector_store_items"

    store_id: Mapped[str] = mapped_column(sa.ForeignKey("vector_stores.id"), primary_key=True)
    document_id: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(40), index=True)
    kind: Mapped[str] = mapped_column(sa.String(16))
    """``file`` (attached from ``/v1/files``) or ``document`` (upserted with its text)."""
    title: Mapped[str] = mapped_column(sa.String(255), default="")
    status: Mapped[str] = mapped_column(sa.String(16))
    error_code: Mapped[str] = mapped_column(sa.String(32), default="")
    error_message: Mapped[str] = mapped_column(sa.Text, default="")
    attributes_json: Mapped[str] = mapped_column(sa.Text, default="{}")
    usage_bytes: Mapped[int] = mapped_column(sa.Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
