"""The retriever's domain types and the checks every write and search applies to them.

Plain dataclasses and enums: the service takes and returns these; ``api`` translates the gRPC
messages and ``messages`` the ``DocumentChanged`` events to and from them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from forge_kit import errors

_COLLECTION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_DOCUMENT_ID_CHARS = 512
MAX_TITLE_CHARS = 4096
MAX_METADATA_PAIRS = 64
MAX_METADATA_CHARS = 1024


class ChangeOutcome(enum.Enum):
    """What became of a document-change event from the topic."""

    APPLIED = "applied"
    UNCHANGED = "unchanged"
    """Same content as held, or a delete of a document not held: nothing to do."""
    STALE = "stale"
    """A version at or below the newest already applied to the document."""
    OWN = "own"
    """The retriever's own event, recording a write it has already made."""


class ChangeKind(enum.Enum):
    """What a document change did to the document."""

    UPSERTED = "upserted"
    DELETED = "deleted"


class SearchMode(enum.Enum):
    """How Search scores chunks."""

    HYBRID = "hybrid"
    DENSE = "dense"
    SPARSE = "sparse"


@dataclass(frozen=True)
class DocumentIn:
    """A document as a caller sends it."""

    id: str
    text: str
    title: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DocumentChange:
    """A change to one document announced by another system (a ``DocumentChanged`` event)."""

    collection: str
    tenant: str
    """Empty: the event names no tenant (the service applies it to ``SOURCE_TENANT``)."""
    document_id: str
    kind: ChangeKind | None
    """None: a change type the retriever does not know (``unknown_kind`` names it)."""
    version: int
    """0: unversioned (always applied)."""
    producer: str
    title: str = ""
    text: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    occurred_at: float | None = None
    """When the change happened (Unix seconds), when the event says."""
    unknown_kind: str = ""
    """The change type as the event gave it, when ``kind`` is None."""


@dataclass(frozen=True)
class UpsertResult:
    """Documents written (changed or new), chunks written for them, documents sent unchanged."""

    upserted: int
    chunks: int
    unchanged: int


@dataclass(frozen=True)
class SearchHit:
    """A chunk found by Search, with its document's metadata plus ``title``."""

    document_id: str
    chunk_id: str
    text: str
    score: float
    sparse_score: float
    dense_score: float
    metadata: dict[str, str]


@dataclass(frozen=True)
class SearchResult:
    """Hits best first; ``mode`` is how they were scored, which may differ from what was asked."""

    hits: list[SearchHit]
    mode: SearchMode
    dense_truncated: bool = False
    """The dense side embedded only the query's first ``max_dense_query_chars`` characters."""


@dataclass(frozen=True)
class CollectionStats:
    """A collection and its sizes."""

    name: str
    document_count: int
    chunk_count: int


def validate_collection(field_name: str, name: str) -> None:
    """Collection names become directory names of the index, so they are restricted."""
    if not name:
        raise errors.ValidationError(field_name, "must not be empty")
    if not _COLLECTION_NAME.fullmatch(name):
        raise errors.ValidationError(
            field_name,
            "must be letters, digits, '_', '-' or '.', start with a letter or digit, at most 128 characters",
        )


def validate_document(prefix: str, doc: DocumentIn, max_chars: int) -> None:
    """Reject a document that could not be indexed, naming the field (``documents[3].text``)."""
    if not doc.id:
        raise errors.ValidationError(f"{prefix}.id", "must not be empty")
    if len(doc.id) > MAX_DOCUMENT_ID_CHARS:
        raise errors.ValidationError(f"{prefix}.id", f"must be at most {MAX_DOCUMENT_ID_CHARS} characters")
    if not doc.text.strip():
        raise errors.ValidationError(f"{prefix}.text", "must not be empty")
    if len(doc.text) > max_chars:
        raise errors.ValidationError(f"{prefix}.text", f"must be at most {max_chars} characters")
    if len(doc.title) > MAX_TITLE_CHARS:
        raise errors.ValidationError(f"{prefix}.title", f"must be at most {MAX_TITLE_CHARS} characters")
    validate_metadata(f"{prefix}.metadata", doc.metadata)
    if "title" in doc.metadata:
        raise errors.ValidationError(
            f"{prefix}.metadata.title", "is reserved: set the document's title field"
        )


def validate_metadata(field_name: str, metadata: Mapping[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise errors.ValidationError(field_name, f"must have at most {MAX_METADATA_PAIRS} entries")
    for key, value in metadata.items():
        if not key:
            raise errors.ValidationError(field_name, "keys must not be empty")
        if len(key) > MAX_METADATA_CHARS or len(value) > MAX_METADATA_CHARS:
            raise errors.ValidationError(
                f"{field_name}.{key}", f"keys and values must be at most {MAX_METADATA_CHARS} characters"
            )


def content_hash(doc: DocumentIn, chunking: str) -> str:
    """Hash of everything that affects the stored document, its chunking included (``chunking``:
    the chunker's version); equal hashes make an upsert a no-op, so after a chunking change a
    document sent again unchanged is chunked anew."""
    body = json.dumps([doc.title, doc.text, sorted(doc.metadata.items()), chunking], ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def chunk_id(document_id: str, index: int) -> str:
    """Caller-facing chunk id, stable for a document and position."""
    return f"{document_id}#{index}"
