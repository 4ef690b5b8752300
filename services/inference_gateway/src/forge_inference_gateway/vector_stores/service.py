"""A tenant's documents on the public API, in the shape of OpenAI's Files and Vector Stores API.

A vector store is one retriever collection named by the store's id, in the caller's tenant (the
retriever keeps tenants apart: another tenant's store id finds nothing). Files are uploaded once
(``upload_file``) and attached to stores (``attach_file``): attaching records the file as
``in_progress``, answers at once, and indexes it in the background — one retriever document whose
id is the file's id, titled with its filename, its attributes as metadata — then marks it
``completed``, or ``failed`` with the reason (``unsupported_file`` for bytes that are not UTF-8
text, ``invalid_file`` for what the retriever refuses, ``server_error`` when it could not be
reached). ``upsert_documents`` writes texts by caller-chosen id, synchronously and idempotently
(the retriever skips unchanged content).

Limits (:class:`DocumentLimits`, the same for every tenant) are checked before anything is
written, and every retriever write is one all-or-nothing call: a refused or failed upload leaves
what the tenant already stored as it was.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
import structlog

from forge_inference_gateway.replicas.upstream import UpstreamError, UpstreamUnavailableError
from forge_inference_gateway.store import TenantRow
from forge_inference_gateway.tenants.registry import Tenant
from forge_inference_gateway.vector_stores.index import DocumentIndex, IndexDocument
from forge_inference_gateway.vector_stores.rows import RagFileRow, VectorStoreItemRow, VectorStoreRow
from forge_inference_gateway.vector_stores.values import (
    FILE_PURPOSES,
    MAX_DOCUMENT_ID_CHARS,
    Attribute,
    check_name,
    file_view,
    index_value,
    item_view,
    store_view,
)
from forge_kit import errors
from forge_kit.db import Database
from forge_kit.limits import RAG_MAX_QUERY_CHARS

log = structlog.get_logger(__name__)


class QuotaExceededError(errors.PermissionDeniedError):
    """A tenant's limit (stores, documents, bytes) would be passed: HTTP 403 ``quota_exceeded``."""


class TooLargeError(errors.ValidationError):
    """One file or one request is over its size limit: HTTP 413 naming the field."""


@dataclass(frozen=True)
class DocumentLimits:
    """Per-tenant limits of the document API (the gateway's ``rag_*`` settings)."""

    max_vector_stores: int = 100
    max_documents: int = 10_000
    """Documents (attached files and upserted texts) over all of a tenant's stores."""
    max_bytes: int = 100 << 20
    """Uploaded files' bytes plus upserted texts' UTF-8 bytes, over all of a tenant's stores."""
    max_file_bytes: int = 1 << 20
    max_batch_documents: int = 100
    max_batch_bytes: int = 2 << 20
    max_search_results: int = 50
    max_query_chars: int = RAG_MAX_QUERY_CHARS
    """The RAG path's one query limit (``RagLimits.max_query_chars``)."""
    index_timeout_s: float = 120.0
    search_timeout_s: float = 10.0


@dataclass(frozen=True)
class DocumentIn:
    """A document of ``upsert_documents``, as the caller sends it."""

    id: str
    text: str
    title: str = ""
    attributes: Mapping[str, Attribute] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchHit:
    """A chunk found by ``search``."""

    document_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, Attribute]


class VectorStores:
    """Files, stores and their documents for each tenant; see the module docstring."""

    def __init__(
        self,
        db: Database,
        index: DocumentIndex,
        limits: DocumentLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._index = index
        self.limits = limits or DocumentLimits()
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    # --- stores -------------------------------------------------------------------------------

    async def create_store(
        self, tenant: Tenant, name: str, metadata: Mapping[str, str], file_ids: Sequence[str] = ()
    ) -> dict[str, object]:
        async with self._db.session() as session:
            held = await session.scalar(
                sa.select(sa.func.count())
                .select_from(VectorStoreRow)
                .where(VectorStoreRow.tenant_id == tenant.id)
            )
            if (held or 0) >= self.limits.max_vector_stores:
                raise QuotaExceededError(
                    f"tenant {tenant.name!r} has {held} vector stores, its limit is {self.limits.max_vector_stores}"
                )
            row = VectorStoreRow(
                id=f"vs_{uuid.uuid4().hex[:24]}",
                tenant_id=tenant.id,
                name=name,
                metadata_json=json.dumps(dict(metadata)),
            )
            session.add(row)
        for file_id in file_ids:
            await self.attach_file(tenant, row.id, file_id, {})
        return await self.get_store(tenant, row.id)

    async def _store_row(self, session: Any, tenant: Tenant, store_id: str) -> VectorStoreRow:
        row = await session.get(VectorStoreRow, store_id) if len(store_id) <= 40 else None
        if row is None or row.tenant_id != tenant.id:
            raise errors.NotFoundError(f"no vector store {store_id!r}")
        return row  # type: ignore[no-any-return]

    async def get_store(self, tenant: Tenant, store_id: str) -> dict[str, object]:
        async with self._db.session() as session:
            row = await self._store_row(session, tenant, store_id)
            return await self._store_view(session, row)

    @staticmethod
    async def _store_view(session: Any, row: VectorStoreRow) -> dict[str, object]:
        counts = dict(
            (
                await session.execute(
                    sa.select(VectorStoreItemRow.status, sa.func.count())
                    .where(VectorStoreItemRow.store_id == row.id)
                    .group_by(VectorStoreItemRow.status)
                )
            ).all()
        )
        usage = await session.scalar(
            sa.select(sa.func.coalesce(sa.func.sum(VectorStoreItemRow.usage_bytes), 0)).where(
                VectorStoreItemRow.store_id == row.id
            )
        )
        return store_view(row, counts, int(usage or 0))

    async def list_stores(self, tenant: Tenant, limit: int, after: str) -> list[dict[str, object]]:
        async with self._db.session() as session:
            query = sa.select(VectorStoreRow).where(VectorStoreRow.tenant_id == tenant.id)
            if after:
                query = query.where(VectorStoreRow.id > after)
            rows = (await session.scalars(query.order_by(VectorStoreRow.id).limit(limit))).all()
            return [await self._store_view(session, r) for r in rows]

    async def delete_store(self, tenant: Tenant, store_id: str) -> None:
        """Remove the store's documents from the retriever, then the store; a retriever failure
        leaves the store as it was (delete again)."""
        async with self._db.session() as session:
            await self._store_row(session, tenant, store_id)
            ids = list(
                (
                    await session.scalars(
                        sa.select(VectorStoreItemRow.document_id).where(
                            VectorStoreItemRow.store_id == store_id
                        )
                    )
                ).all()
            )
        for at in range(0, len(ids), self.limits.max_batch_documents):
            await self._index.delete(
                tenant.name,
                store_id,
                ids[at : at + self.limits.max_batch_documents],
                self.limits.index_timeout_s,
            )
        async with self._db.session() as session:
            await session.execute(
                sa.delete(VectorStoreItemRow).where(VectorStoreItemRow.store_id == store_id)
            )
            await session.execute(sa.delete(VectorStoreRow).where(VectorStoreRow.id == store_id))

    async def collection_of(self, tenant: Tenant, store_id: str) -> str:
        """The retriever collection a RAG query over ``store_id`` searches (404 if not the tenant's)."""
        async with self._db.session() as session:
            return (await self._store_row(session, tenant, store_id)).id

    # --- files --------------------------------------------------------------------------------

    async def _usage(self, session: Any, tenant: Tenant) -> tuple[int, int]:
        """(documents, bytes) the tenant holds."""
        documents = await session.scalar(
            sa.select(sa.func.count())
            .select_from(VectorStoreItemRow)
            .where(VectorStoreItemRow.tenant_id == tenant.id)
        )
        file_bytes = await session.scalar(
            sa.select(sa.func.coalesce(sa.func.sum(RagFileRow.size), 0)).where(
                RagFileRow.tenant_id == tenant.id
            )
        )
        text_bytes = await session.scalar(
            sa.select(sa.func.coalesce(sa.func.sum(VectorStoreItemRow.usage_bytes), 0)).where(
                VectorStoreItemRow.tenant_id == tenant.id, VectorStoreItemRow.kind == "document"
            )
        )
        return int(documents or 0), int(file_bytes or 0) + int(text_bytes or 0)

    def _check_quota(self, tenant: Tenant, held: tuple[int, int], documents: int, size: int) -> None:
        if held[0] + documents > self.limits.max_documents:
            raise QuotaExceededError(
                f"tenant {tenant.name!r} holds {held[0]} documents; {documents} more would pass its limit"
                f" of {self.limits.max_documents}"
            )
        if held[1] + size > self.limits.max_bytes:
            raise QuotaExceededError(
                f"tenant {tenant.name!r} stores {held[1]} bytes; {size} more would pass its limit"
                f" of {self.limits.max_bytes}"
            )

    async def upload_file(
        self, tenant: Tenant, filename: str, purpose: str, content: bytes
    ) -> dict[str, object]:
        if purpose not in FILE_PURPOSES:
            raise errors.ValidationError("purpose", f"must be one of {', '.join(FILE_PURPOSES)}")
        filename = check_name("file", filename, required=True)
        if not content:
            raise errors.ValidationError("file", "must not be empty")
        if len(content) > self.limits.max_file_bytes:
            raise TooLargeError(
                "file", f"must be at most {self.limits.max_file_bytes} bytes, got {len(content)}"
            )
        async with self._db.session() as session:
            self._check_quota(tenant, await self._usage(session, tenant), 0, len(content))
            row = RagFileRow(
                id=f"file-{uuid.uuid4().hex[:24]}",
                tenant_id=tenant.id,
                filename=filename,
                purpose=purpose,
                size=len(content),
                content=content,
            )
            session.add(row)
        return file_view(row)

    async def _file_row(self, session: Any, tenant: Tenant, file_id: str) -> RagFileRow:
        row = await session.get(RagFileRow, file_id) if len(file_id) <= 40 else None
        if row is None or row.tenant_id != tenant.id:
            raise errors.NotFoundError(f"no file {file_id!r}")
        return row  # type: ignore[no-any-return]

    async def get_file(self, tenant: Tenant, file_id: str) -> dict[str, object]:
        async with self._db.session() as session:
            return file_view(await self._file_row(session, tenant, file_id))

    async def list_files(self, tenant: Tenant, limit: int, after: str) -> list[dict[str, object]]:
        async with self._db.session() as session:
            query = sa.select(RagFileRow).where(RagFileRow.tenant_id == tenant.id)
            if after:
                query = query.where(RagFileRow.id > after)
            rows = (await session.scalars(query.order_by(RagFileRow.id).limit(limit))).all()
        return [file_view(r) for r in rows]

    async def delete_file(self, tenant: Tenant, file_id: str) -> None:
        """Detach the file from every store (removing it from the index), then delete its bytes."""
        async with self._db.session() as session:
            await self._file_row(session, tenant, file_id)
            stores = list(
                (
                    await session.scalars(
                        sa.select(VectorStoreItemRow.store_id).where(
                            VectorStoreItemRow.tenant_id == tenant.id,
                            VectorStoreItemRow.document_id == file_id,
                            VectorStoreItemRow.kind == "file",
                        )
                    )
                ).all()
            )
        for store_id in stores:
            await self.remove(tenant, store_id, file_id)
        async with self._db.session() as session:
            await session.execute(sa.delete(RagFileRow).where(RagFileRow.id == file_id))

    # --- a store's documents ------------------------------------------------------------------

    async def attach_file(
        self, tenant: Tenant, store_id: str, file_id: str, attributes: Mapping[str, Attribute]
    ) -> dict[str, object]:
        """Record the file as ``in_progress`` in the store and index it in the background. A file
        already attached is answered as it stands (a failed one is tried again)."""
        async with self._db.session() as session:
            await self._store_row(session, tenant, store_id)
            file = await self._file_row(session, tenant, file_id)
            row = await session.get(VectorStoreItemRow, (store_id, file_id))
            if row is not None and row.status != "failed":
                return item_view(row)
            if row is None:
                self._check_quota(tenant, await self._usage(session, tenant), 1, 0)
                row = VectorStoreItemRow(
                    store_id=store_id,
                    document_id=file_id,
                    tenant_id=tenant.id,
                    kind="file",
                    title=file.filename,
                    usage_bytes=file.size,
                )
                session.add(row)
            row.status, row.error_code, row.error_message = "in_progress", "", ""
            row.attributes_json = json.dumps(dict(attributes))
            view = item_view(row)
        self._spawn(self._index_file(tenant, store_id, file_id))
        return view

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _index_file(self, tenant: Tenant, store_id: str, file_id: str) -> None:
        """Background: one retriever upsert for the file, then its status."""
        async with self._db.session() as session:
            file = await session.get(RagFileRow, file_id)
            item = await session.get(VectorStoreItemRow, (store_id, file_id))
            if file is None or item is None:
                return
            content, filename, attributes = file.content, file.filename, json.loads(item.attributes_json)
        status, code, message = "completed", "", ""
        try:
            text = content.decode("utf-8")
            if not text.strip():
                raise errors.ValidationError("file", "holds no text")
            document = IndexDocument(
                id=file_id,
                text=text,
                title=filename,
                metadata={"filename": filename} | {k: index_value(v) for k, v in attributes.items()},
            )
            await self._index.upsert(tenant.name, store_id, [document], self.limits.index_timeout_s)
        except UnicodeDecodeError as exc:
            status, code, message = (
                "failed",
                "unsupported_file",
                f"not UTF-8 text: {exc.reason} at byte {exc.start}",
            )
        except errors.ValidationError as exc:
            status, code, message = "failed", "invalid_file", str(exc)
        except (TimeoutError, UpstreamError, UpstreamUnavailableError, errors.ForgeError) as exc:
            status, code, message = (
                "failed",
                "server_error",
                str(exc) or "the retriever did not answer in time",
            )
        except Exception as exc:
            log.exception("vector_store.index_failed", store=store_id, file=file_id)
            status, code, message = "failed", "server_error", type(exc).__name__
        async with self._db.session() as session:
            item = await session.get(VectorStoreItemRow, (store_id, file_id))
            if item is not None and item.status == "in_progress":
                item.status, item.error_code, item.error_message = status, code, message[:2000]
        if item is None and status == "completed":
            # Detached (or its store deleted) while it was being indexed: take it out again.
            try:
                await self._index.delete(tenant.name, store_id, [file_id], self.limits.index_timeout_s)
            except (TimeoutError, errors.ForgeError, UpstreamError) as exc:
                log.warning("vector_store.orphan_left", store=store_id, file=file_id, error=str(exc))

    async def resume(self) -> int:
        """Index again what was ``in_progress`` when the gateway stopped (at start-up); how many."""
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(
                        VectorStoreItemRow.store_id, VectorStoreItemRow.document_id, VectorStoreRow.tenant_id
                    )
                    .join(VectorStoreRow, VectorStoreRow.id == VectorStoreItemRow.store_id)
                    .where(VectorStoreItemRow.status == "in_progress", VectorStoreItemRow.kind == "file")
                )
            ).all()
            tenants = {}
            for tenant_row in (await session.scalars(sa.select(TenantRow))).all():
                tenants[tenant_row.id] = Tenant(
                    tenant_row.id, tenant_row.name, tenant_row.priority_class, tenant_row.rpm_limit
                )
        for store_id, document_id, tenant_id in rows:
            if tenant_id in tenants:
                self._spawn(self._index_file(tenants[tenant_id], store_id, document_id))
        return len(rows)

    async def get_item(self, tenant: Tenant, store_id: str, document_id: str) -> dict[str, object]:
        async with self._db.session() as session:
            await self._store_row(session, tenant, store_id)
            row = await session.get(VectorStoreItemRow, (store_id, document_id))
            if row is None:
                raise errors.NotFoundError(f"no file {document_id!r} in vector store {store_id!r}")
            return item_view(row)

    async def list_items(
        self, tenant: Tenant, store_id: str, limit: int, after: str, status: str | None
    ) -> list[dict[str, object]]:
        async with self._db.session() as session:
            await self._store_row(session, tenant, store_id)
            query = sa.select(VectorStoreItemRow).where(VectorStoreItemRow.store_id == store_id)
            if status:
                query = query.where(VectorStoreItemRow.status == status)
            if after:
                query = query.where(VectorStoreItemRow.document_id > after)
            rows = (await session.scalars(query.order_by(VectorStoreItemRow.document_id).limit(limit))).all()
        return [item_view(r) for r in rows]

    async def remove(self, tenant: Tenant, store_id: str, document_id: str) -> None:
        """Remove one document from the store and the index (the file itself stays)."""
        async with self._db.session() as session:
            await self._store_row(session, tenant, store_id)
            if await session.get(VectorStoreItemRow, (store_id, document_id)) is None:
                raise errors.NotFoundError(f"no file {document_id!r} in vector store {store_id!r}")
        await self._index.delete(tenant.name, store_id, [document_id], self.limits.index_timeout_s)
        async with self._db.session() as session:
            await session.execute(
                sa.delete(VectorStoreItemRow).where(
                    VectorStoreItemRow.store_id == store_id, VectorStoreItemRow.document_id == document_id
                )
            )

    async def upsert_documents(
        self, tenant: Tenant, store_id: str, documents: Sequence[DocumentIn]
    ) -> dict[str, object]:
        """Write texts by id in one retriever call (all or nothing), then record them ``completed``.
        Sending the same batch again changes nothing (idempotent by id and content)."""
        # 1. Check the batch whole, before anything is written.
        if not documents:
            raise errors.ValidationError("documents", "must not be empty")
        if len(documents) > self.limits.max_batch_documents:
            raise TooLargeError("documents", f"must have at most {self.limits.max_batch_documents} entries")
        seen: set[str] = set()
        size = 0
        for i, doc in enumerate(documents):
            if not doc.id or len(doc.id) > MAX_DOCUMENT_ID_CHARS or not doc.id.isprintable():
                raise errors.ValidationError(
                    f"documents[{i}].id", f"must be 1 to {MAX_DOCUMENT_ID_CHARS} printable characters"
                )
            if doc.id.startswith("file-"):
                raise errors.ValidationError(f"documents[{i}].id", "'file-' ids are the uploaded files'")
            if doc.id in seen:
                raise errors.ValidationError(f"documents[{i}].id", f"duplicate id {doc.id!r} in the request")
            seen.add(doc.id)
            if not doc.text.strip():
                raise errors.ValidationError(f"documents[{i}].text", "must not be empty")
            size += len(doc.text.encode())
        if size > self.limits.max_batch_bytes:
            raise TooLargeError("documents", f"texts must total at most {self.limits.max_batch_bytes} bytes")
        # 2. Check the tenant's limits against what the batch adds.
        async with self._db.session() as session:
            await self._store_row(session, tenant, store_id)
            held_rows = {
                r.document_id: r
                for r in (
                    await session.scalars(
                        sa.select(VectorStoreItemRow).where(
                            VectorStoreItemRow.store_id == store_id, VectorStoreItemRow.document_id.in_(seen)
                        )
                    )
                ).all()
            }
            new = [d for d in documents if d.id not in held_rows]
            replaced = sum(r.usage_bytes for r in held_rows.values() if r.kind == "document")
            self._check_quota(tenant, await self._usage(session, tenant), len(new), max(0, size - replaced))
        # 3. One retriever write: the batch lands whole or not at all.
        written = await self._index.upsert(
            tenant.name,
            store_id,
            [
                IndexDocument(
                    id=d.id,
                    text=d.text,
                    title=d.title,
                    metadata={k: index_value(v) for k, v in d.attributes.items()},
                )
                for d in documents
            ],
            self.limits.index_timeout_s,
        )
        # 4. Record what the store holds.
        async with self._db.session() as session:
            for doc in documents:
                row = await session.get(VectorStoreItemRow, (store_id, doc.id))
                if row is None:
                    row = VectorStoreItemRow(store_id=store_id, document_id=doc.id, tenant_id=tenant.id)
                    session.add(row)
                row.kind, row.title, row.status, row.error_code, row.error_message = (
                    "document",
                    doc.title[:255],
                    "completed",
                    "",
                    "",
                )
                row.attributes_json = json.dumps(dict(doc.attributes))
                row.usage_bytes = len(doc.text.encode())
        return {
            "object": "vector_store.documents.batch",
            "upserted": written,
            "unchanged": len(documents) - written,
        }

    async def search(
        self, tenant: Tenant, store_id: str, query: str, max_results: int, where: Mapping[str, Attribute]
    ) -> list[SearchHit]:
        if not query.strip():
            raise errors.ValidationError("query", "must not be empty")
        if len(query) > self.limits.max_query_chars:
            raise errors.ValidationError("query", f"must be at most {self.limits.max_query_chars} characters")
        if not 1 <= max_results <= self.limits.max_search_results:
            raise errors.ValidationError(
                "max_num_results",
                f"must be between 1 and {self.limits.max_search_results}, got {max_results}",
            )
        await self.collection_of(tenant, store_id)
        found = await self._index.search(
            tenant.name,
            store_id,
            query,
            max_results,
            {k: index_value(v) for k, v in where.items()},
            self.limits.search_timeout_s,
        )
        async with self._db.session() as session:
            rows = {
                r.document_id: r
                for r in (
                    await session.scalars(
                        sa.select(VectorStoreItemRow).where(
                            VectorStoreItemRow.store_id == store_id,
                            VectorStoreItemRow.document_id.in_({c.document_id for c in found}),
                        )
                    )
                ).all()
            }
        return [
            SearchHit(
                document_id=c.document_id,
                filename=rows[c.document_id].title if c.document_id in rows else c.metadata.get("title", ""),
                score=c.score,
                text=c.text,
                attributes=json.loads(rows[c.document_id].attributes_json) if c.document_id in rows else {},
            )
            for c in found
        ]

    async def close(self) -> None:
        """Stop background indexing; what it left ``in_progress`` is indexed again by :meth:`resume`."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
