"""``/v1/files`` and ``/v1/vector_stores``: OpenAI's Files and Vector Stores API over a tenant's
documents (``service.py``), translation only; plus one Forge route, ``POST
/v1/vector_stores/{id}/documents``, that upserts texts by id in batches.

Errors use the OpenAI format: 400 naming the field, 403 ``quota_exceeded`` past a tenant's limit,
404 for a store or file that is not the caller's, 413 for a file or batch over its size limit,
503 when the retriever cannot be reached. Lists are in id order, paged with ``limit`` and
``after``. A file's status answer carries ``openai-poll-after-ms`` so the SDK's ``*_and_poll``
helpers ask again soon.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from forge_inference_gateway.tenants.registry import Tenant
from forge_inference_gateway.vector_stores.service import (
    DocumentIn,
    QuotaExceededError,
    TooLargeError,
    VectorStores,
)
from forge_inference_gateway.vector_stores.values import (
    MAX_ATTRIBUTES,
    Attribute,
    check_attributes,
    check_name,
)
from forge_kit import errors
from forge_kit.openai_errors import openai_error

#: How soon the SDK's polling helpers ask again about a file being indexed.
POLL_AFTER_MS = "200"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChunkingStrategy(_Strict):
    """Only ``auto``: documents are chunked by the retriever's own chunker."""

    type: Literal["auto"]


class VectorStoreCreate(_Strict):
    name: str | None = Field(default=None, max_length=255)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_ATTRIBUTES)
    file_ids: list[str] = Field(default_factory=list, max_length=100)
    chunking_strategy: ChunkingStrategy | None = None


class FileAttach(_Strict):
    file_id: str = Field(max_length=64)
    attributes: dict[str, Attribute] | None = None
    chunking_strategy: ChunkingStrategy | None = None


class DocumentBody(_Strict):
    id: str = Field(max_length=256)
    text: str
    title: str = Field(default="", max_length=255)
    attributes: dict[str, Attribute] | None = None


class DocumentsUpsert(_Strict):
    documents: list[DocumentBody]


class ComparisonFilter(_Strict):
    """Only equality (``eq``) on an attribute; a compound filter ANDs them."""

    type: Literal["eq"]
    key: str = Field(max_length=64)
    value: Attribute


class CompoundFilter(_Strict):
    type: Literal["and"]
    filters: list[ComparisonFilter] = Field(max_length=16)


class SearchBody(_Strict):
    query: str | list[str]
    max_num_results: int = 10
    filters: ComparisonFilter | CompoundFilter | None = None
    rewrite_query: Literal[False] = False
    ranking_options: dict[str, Any] | None = None


class FileCounts(BaseModel):
    in_progress: int
    completed: int
    failed: int
    cancelled: int
    total: int


class VectorStoreOut(BaseModel):
    id: str
    object: Literal["vector_store"]
    created_at: int
    name: str
    usage_bytes: int
    file_counts: FileCounts
    status: Literal["in_progress", "completed"]
    metadata: dict[str, str]
    expires_after: None = None
    expires_at: None = None
    last_active_at: int


class LastError(BaseModel):
    code: Literal["server_error", "unsupported_file", "invalid_file"]
    message: str


class VectorStoreFileOut(BaseModel):
    id: str
    object: Literal["vector_store.file"]
    created_at: int
    vector_store_id: str
    status: Literal["in_progress", "completed", "failed"]
    last_error: LastError | None
    usage_bytes: int
    attributes: dict[str, Attribute]
    chunking_strategy: dict[str, Any]


class FileOut(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    expires_at: None = None


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool


class ListPage(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class SearchContent(BaseModel):
    type: Literal["text"]
    text: str


class SearchResult(BaseModel):
    file_id: str
    filename: str
    score: float
    attributes: dict[str, Attribute]
    content: list[SearchContent]


class SearchPage(BaseModel):
    object: Literal["vector_store.search_results.page"]
    search_query: list[str]
    data: list[SearchResult]
    has_more: bool
    next_page: None = None


class UpsertOut(BaseModel):
    object: Literal["vector_store.documents.batch"]
    upserted: int
    """Documents written (new or changed)."""
    unchanged: int
    """Documents whose id and content were already held: nothing was written for them."""


Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str, Query(max_length=512)]


def _page(items: list[dict[str, object]], limit: int) -> dict[str, object]:
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


def _where(filters: ComparisonFilter | CompoundFilter | None) -> dict[str, Attribute]:
    if filters is None:
        return {}
    parts = filters.filters if isinstance(filters, CompoundFilter) else [filters]
    return {f.key: f.value for f in parts}


def _record(request: Request, **usage: int) -> None:
    """Count usage against the request's key, where the authenticating dependency set a recorder."""
    record = getattr(request.state, "record", None)
    if record is not None:
        record(**usage)


class VectorStoreRoutes:
    def __init__(self, stores: VectorStores) -> None:
        self._stores = stores

    async def create_store(self, request: Request, body: VectorStoreCreate) -> dict[str, object]:
        name = check_name("name", body.name)
        return await self._stores.create_store(request.state.tenant, name, body.metadata or {}, body.file_ids)

    async def list_stores(self, request: Request, limit: Limit = 20, after: After = "") -> dict[str, object]:
        return _page(await self._stores.list_stores(request.state.tenant, limit + 1, after), limit)

    async def get_store(self, request: Request, store_id: str) -> dict[str, object]:
        return await self._stores.get_store(request.state.tenant, store_id)

    async def delete_store(self, request: Request, store_id: str) -> dict[str, object]:
        await self._stores.delete_store(request.state.tenant, store_id)
        return {"id": store_id, "object": "vector_store.deleted", "deleted": True}

    async def upload_file(
        self,
        request: Request,
        file: Annotated[UploadFile, File()],
        purpose: Annotated[str, Form(max_length=32)],
    ) -> dict[str, object]:
        limit = self._stores.limits.max_file_bytes
        content = await file.read(limit + 1)
        if len(content) > limit:
            raise TooLargeError("file", f"must be at most {limit} bytes")
        return await self._stores.upload_file(request.state.tenant, file.filename or "", purpose, content)

    async def list_files(self, request: Request, limit: Limit = 20, after: After = "") -> dict[str, object]:
        return _page(await self._stores.list_files(request.state.tenant, limit + 1, after), limit)

    async def get_file(self, request: Request, file_id: str) -> dict[str, object]:
        return await self._stores.get_file(request.state.tenant, file_id)

    async def delete_file(self, request: Request, file_id: str) -> dict[str, object]:
        await self._stores.delete_file(request.state.tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def attach_file(self, request: Request, store_id: str, body: FileAttach) -> JSONResponse:
        attributes = check_attributes("attributes", body.attributes)
        view = await self._stores.attach_file(request.state.tenant, store_id, body.file_id, attributes)
        _record(request, documents=1)
        return JSONResponse(view, headers={"openai-poll-after-ms": POLL_AFTER_MS})

    async def list_items(
        self,
        request: Request,
        store_id: str,
        limit: Limit = 20,
        after: After = "",
        filter: Literal["in_progress", "completed", "failed"] | None = None,
    ) -> dict[str, object]:
        items = await self._stores.list_items(request.state.tenant, store_id, limit + 1, after, filter)
        return _page(items, limit)

    async def get_item(self, request: Request, store_id: str, file_id: str) -> JSONResponse:
        view = await self._stores.get_item(request.state.tenant, store_id, file_id)
        return JSONResponse(view, headers={"openai-poll-after-ms": POLL_AFTER_MS})

    async def remove_item(self, request: Request, store_id: str, file_id: str) -> dict[str, object]:
        await self._stores.remove(request.state.tenant, store_id, file_id)
        return {"id": file_id, "object": "vector_store.file.deleted", "deleted": True}

    async def upsert_documents(
        self, request: Request, store_id: str, body: DocumentsUpsert
    ) -> dict[str, object]:
        documents = [
            DocumentIn(d.id, d.text, d.title, check_attributes(f"documents[{i}].attributes", d.attributes))
            for i, d in enumerate(body.documents)
        ]
        result = await self._stores.upsert_documents(request.state.tenant, store_id, documents)
        _record(request, documents=int(str(result["upserted"])))
        return result

    async def search(self, request: Request, store_id: str, body: SearchBody) -> dict[str, object]:
        queries = [body.query] if isinstance(body.query, str) else body.query
        if len(queries) != 1:
            raise errors.ValidationError("query", "give one query")
        hits = await self._stores.search(
            request.state.tenant, store_id, queries[0], body.max_num_results, _where(body.filters)
        )
        return {
            "object": "vector_store.search_results.page",
            "search_query": queries,
            "data": [
                {
                    "file_id": h.document_id,
                    "filename": h.filename,
                    "score": h.score,
                    "attributes": h.attributes,
                    "content": [{"type": "text", "text": h.text}],
                }
                for h in hits
            ],
            "has_more": False,
            "next_page": None,
        }


Dependency = Callable[[Request], Awaitable[None]]


def install_vector_store_api(
    app: FastAPI, stores: VectorStores, read: Sequence[Any], write: Sequence[Any]
) -> None:
    """Add the routes; ``read`` and ``write`` are the dependencies that authenticate the caller
    (setting ``request.state.tenant``) for reading and for changing its documents."""
    routes = VectorStoreRoutes(stores)
    for path, endpoint, method, deps, model in (
        ("/v1/vector_stores", routes.create_store, "POST", write, VectorStoreOut),
        ("/v1/vector_stores", routes.list_stores, "GET", read, ListPage),
        ("/v1/vector_stores/{store_id}", routes.get_store, "GET", read, VectorStoreOut),
        ("/v1/vector_stores/{store_id}", routes.delete_store, "DELETE", write, Deleted),
        ("/v1/vector_stores/{store_id}/files", routes.attach_file, "POST", write, VectorStoreFileOut),
        ("/v1/vector_stores/{store_id}/files", routes.list_items, "GET", read, ListPage),
        ("/v1/vector_stores/{store_id}/files/{file_id}", routes.get_item, "GET", read, VectorStoreFileOut),
        ("/v1/vector_stores/{store_id}/files/{file_id}", routes.remove_item, "DELETE", write, Deleted),
        ("/v1/vector_stores/{store_id}/documents", routes.upsert_documents, "POST", write, UpsertOut),
        ("/v1/vector_stores/{store_id}/search", routes.search, "POST", read, SearchPage),
        ("/v1/files", routes.upload_file, "POST", write, FileOut),
        ("/v1/files", routes.list_files, "GET", read, ListPage),
        ("/v1/files/{file_id}", routes.get_file, "GET", read, FileOut),
        ("/v1/files/{file_id}", routes.delete_file, "DELETE", write, Deleted),
    ):
        app.add_api_route(path, endpoint, methods=[method], dependencies=list(deps), response_model=model)

    @app.exception_handler(QuotaExceededError)
    async def _quota(_: Request, exc: QuotaExceededError) -> JSONResponse:
        return openai_error(403, exc.message, type_="invalid_request_error", code="quota_exceeded")

    @app.exception_handler(TooLargeError)
    async def _too_large(_: Request, exc: TooLargeError) -> JSONResponse:
        return openai_error(413, exc.message, param=exc.field, code="request_too_large")


async def name_store(
    stores: VectorStores | None, tenant: Tenant, body: object, within: str | None = None
) -> object:
    """A RAG request that names ``vector_store_id`` (at the top, or in its ``within`` object) as the
    same request naming that store's collection; 404 when the store is not the caller's."""
    holder = body.get(within) if isinstance(body, dict) and within else body
    if not isinstance(holder, dict) or "vector_store_id" not in holder:
        return body
    prefix = f"{within}." if within else ""
    store_id = holder["vector_store_id"]
    if "collection" in holder:
        raise errors.ValidationError(f"{prefix}vector_store_id", "give either collection or vector_store_id")
    if not isinstance(store_id, str) or not store_id:
        raise errors.ValidationError(f"{prefix}vector_store_id", "must be a vector store id")
    if stores is None:
        raise errors.NotFoundError("vector stores are not configured on this gateway")
    named = {k: v for k, v in holder.items() if k != "vector_store_id"}
    named["collection"] = await stores.collection_of(tenant, store_id)
    return {**body, within: named} if within and isinstance(body, dict) else named
