"""``DocumentChanged`` events to and from the retriever's domain types: translation only.

The service stages the events these functions build (outbox); the document-change consumer's
handler (``api.document_change_handler``) reads a topic's events into :class:`DocumentChange`.
"""

from __future__ import annotations

from forge.events.v1 import events_pb2

from forge_retriever.documents import ChangeKind, DocumentChange, DocumentIn

_KINDS = {
    events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED: ChangeKind.UPSERTED,
    events_pb2.DOCUMENT_CHANGE_TYPE_DELETED: ChangeKind.DELETED,
}


def upserted_event(collection: str, tenant: str, doc: DocumentIn, version: int) -> events_pb2.DocumentChanged:
    return events_pb2.DocumentChanged(
        collection=collection,
        tenant=tenant,
        document_id=doc.id,
        change=events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED,
        version=version,
        title=doc.title,
        text=doc.text,
        metadata=dict(doc.metadata),
    )


def deleted_event(collection: str, tenant: str, document_id: str, version: int) -> events_pb2.DocumentChanged:
    return events_pb2.DocumentChanged(
        collection=collection,
        document_id=document_id,
        change=events_pb2.DOCUMENT_CHANGE_TYPE_DELETED,
        version=version,
        tenant=tenant,
    )


def document_change(event: events_pb2.DocumentChanged) -> DocumentChange:
    """The change an event announces, as the service applies it (nothing is checked here)."""
    kind = _KINDS.get(event.change)
    return DocumentChange(
        collection=event.collection,
        tenant=event.tenant,
        document_id=event.document_id,
        kind=kind,
        version=event.version,
        producer=event.meta.producer,
        title=event.title,
        text=event.text,
        metadata=dict(event.metadata),
        occurred_at=event.meta.occurred_at.ToNanoseconds() / 1e9
        if event.meta.HasField("occurred_at")
        else None,
        unknown_kind="" if kind is not None else str(event.change),
    )
