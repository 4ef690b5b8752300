"""The values of the document API (``service.py``): the checks its inputs get and the
OpenAI-shaped objects it answers with (``vector_store``, ``vector_store.file``, ``file``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from forge_inference_gateway.vector_stores.rows import RagFileRow, VectorStoreItemRow, VectorStoreRow
from forge_kit import errors

Attribute = str | int | float | bool
MAX_ATTRIBUTES = 16
MAX_ATTRIBUTE_KEY_CHARS = 64
MAX_ATTRIBUTE_VALUE_CHARS = 512
MAX_NAME_CHARS = 255
MAX_DOCUMENT_ID_CHARS = 256
#: Attribute keys the index reserves for itself.
RESERVED_ATTRIBUTES = ("title", "filename")
FILE_PURPOSES = ("assistants", "user_data")
STATUSES = ("in_progress", "completed", "failed")


def _unix(value: Any) -> int:
    return int(value.timestamp()) if value is not None else 0


def store_view(row: VectorStoreRow, counts: Mapping[str, int], usage_bytes: int) -> dict[str, object]:
    """A store as OpenAI's ``vector_store`` object."""
    file_counts = {s: counts.get(s, 0) for s in STATUSES} | {"cancelled": 0}
    file_counts["total"] = sum(counts.values())
    return {
        "id": row.id,
        "object": "vector_store",
        "created_at": _unix(row.created_at),
        "name": row.name,
        "usage_bytes": usage_bytes,
        "file_counts": file_counts,
        "status": "in_progress" if counts.get("in_progress") else "completed",
        "metadata": json.loads(row.metadata_json),
        "expires_after": None,
        "expires_at": None,
        "last_active_at": _unix(row.created_at),
    }


def item_view(row: VectorStoreItemRow) -> dict[str, object]:
    """A store's document as OpenAI's ``vector_store.file`` object."""
    error = {"code": row.error_code, "message": row.error_message} if row.status == "failed" else None
    return {
        "id": row.document_id,
        "object": "vector_store.file",
        "created_at": _unix(row.created_at),
        "vector_store_id": row.store_id,
        "status": row.status,
        "last_error": error,
        "usage_bytes": row.usage_bytes,
        "attributes": json.loads(row.attributes_json),
        "chunking_strategy": {"type": "static", "static": None},
    }


def file_view(row: RagFileRow) -> dict[str, object]:
    """An uploaded file as OpenAI's ``file`` object."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.size,
        "created_at": _unix(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
    }


def check_attributes(field_name: str, raw: object) -> dict[str, Attribute]:
    """OpenAI's attribute rules: at most 16 pairs, keys up to 64 characters, values strings up to
    512 characters, numbers or booleans; ``title`` and ``filename`` are the index's own."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise errors.ValidationError(field_name, "must be an object")
    if len(raw) > MAX_ATTRIBUTES:
        raise errors.ValidationError(field_name, f"must have at most {MAX_ATTRIBUTES} entries")
    for key, value in raw.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ATTRIBUTE_KEY_CHARS:
            raise errors.ValidationError(
                field_name, f"keys must be 1 to {MAX_ATTRIBUTE_KEY_CHARS} characters"
            )
        if key in RESERVED_ATTRIBUTES:
            raise errors.ValidationError(f"{field_name}.{key}", "is reserved")
        if isinstance(value, str):
            if len(value) > MAX_ATTRIBUTE_VALUE_CHARS:
                raise errors.ValidationError(
                    f"{field_name}.{key}", f"must be at most {MAX_ATTRIBUTE_VALUE_CHARS} characters"
                )
        elif isinstance(value, float) and not math.isfinite(value):
            raise errors.ValidationError(f"{field_name}.{key}", "must be a finite number")
        elif not isinstance(value, bool | int | float):
            raise errors.ValidationError(f"{field_name}.{key}", "must be a string, a number or a boolean")
    return dict(raw)


def index_value(value: Attribute) -> str:
    """How an attribute is held as retriever metadata (a string): a string as it is, a number or a
    boolean as JSON (``3``, ``2.5``, ``true``), so an ``eq`` filter matches the same text."""
    return value if isinstance(value, str) else json.dumps(value)


def check_name(field_name: str, value: object, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise errors.ValidationError(
            field_name, "must be a non-empty string" if required else "must be a string"
        )
    if len(value) > MAX_NAME_CHARS or not value.isprintable():
        raise errors.ValidationError(field_name, f"must be printable, at most {MAX_NAME_CHARS} characters")
    return value
