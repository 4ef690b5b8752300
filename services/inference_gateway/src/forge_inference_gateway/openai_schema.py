"""The public API's request checks and its OpenAPI document.

Generation bodies are checked against the kit's OpenAI request models before routing (400 naming
the field, ``unsupported_parameter`` for what no replica can honour, an ``image_url`` part that is
neither a ``data:image/…`` URI nor an http(s) URL), so a client learns what is wrong without a
round trip to a replica; the body goes upstream as sent, images included (whether the model reads
images, and the image itself, the model server checks: its 400 comes back as it is).

The OpenAPI document describes what the routes really take and answer, so code generators work:
the request bodies (the routes read raw JSON, so FastAPI cannot infer them), the bearer scheme,
and the statuses actually returned, every error in the OpenAI shape (400 where FastAPI would
document 422).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from forge_kit import errors
from forge_kit.limits import RAG_MAX_QUERY_CHARS
from forge_kit.openai_protocol import (
    ChatCompletionBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    ErrorBody,
    TokenizeBody,
    check_sampling,
    message_parts,
    parse,
)

#: Documents the bearer scheme on every route that takes a key (a tenant's API key on ``/v1``,
#: the service token on ``/admin``); the check itself is the routes' dependency.
bearer_scheme = HTTPBearer(auto_error=False, description="A tenant API key (``/v1``) or the admin token.")


class RagQueryBody(BaseModel):
    """``POST /v1/rag/query`` as ``rag.parse_query`` takes it (documentation only: the bounds of
    ``top_k``, ``top_n``, the context and the timeout are the gateway's settings)."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(
        min_length=1,
        max_length=RAG_MAX_QUERY_CHARS,
        description="The question; whitespace-only is refused. At most the gateway's"
        " rag_max_query_chars (65,536 by default), the one query limit of the RAG path.",
    )
    collection: str | None = Field(
        default=None, min_length=1, description="A retriever collection; give this or vector_store_id."
    )
    vector_store_id: str | None = Field(
        default=None, min_length=1, description="One of the caller's vector stores (/v1/vector_stores)."
    )
    model: str = Field(min_length=1, description="The model (or alias) that writes the answer.")
    top_k: int | None = Field(default=None, ge=1, description="Chunks retrieved.")
    top_n: int | None = Field(default=None, ge=1, description="Chunks kept after reranking (at most top_k).")
    max_context_tokens: int | None = Field(default=None, ge=16)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    temperature: float = Field(default=0.0, ge=0, le=2)
    stream: bool = False
    filter: dict[str, str] | None = Field(default=None, description="Exact-match metadata filter.")
    timeout_s: float | None = Field(default=None, gt=0)


#: Request bodies of the routes that read raw JSON.
REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionBody,
    ("/v1/chat/completions", "post"): ChatCompletionBody,
    ("/v1/embeddings", "post"): EmbeddingBody,
    ("/v1/rag/query", "post"): RagQueryBody,
    ("/tokenize", "post"): TokenizeBody,
    ("/detokenize", "post"): DetokenizeBody,
}

_DESCRIPTIONS = {
    "400": "Invalid request: `error.param` names the field.",
    "401": "Missing, invalid, expired or revoked bearer token.",
    "403": "The key lacks the route's scope, or a tenant limit would be passed (code quota_exceeded).",
    "404": "No such model, collection or resource.",
    "409": "Conflicts with the resource's current state.",
    "413": "Request body too large.",
    "429": "Rate limit or queue full; see Retry-After.",
    "502": "A replica failed.",
    "503": "No replica available; see Retry-After.",
    "504": "Deadline exceeded.",
}
_GENERATION = ("400", "401", "403", "404", "413", "429", "502", "503", "504")
_ERRORS_BY_PREFIX = (
    ("/v1/models", ("401", "404", "429", "502", "503")),
    ("/v1/keys", ("401", "429")),
    ("/v1/files", ("400", "401", "403", "404", "413", "429", "503")),
    ("/v1/vector_stores", ("400", "401", "403", "404", "413", "429", "503", "504")),
    ("/v1/embeddings", ("400", "401", "404", "413", "429", "502", "503", "504")),
    ("/v1/", _GENERATION),
    ("/tokenize", _GENERATION),  # and /tokenizer_info
    ("/detokenize", _GENERATION),
    ("/admin/", ("400", "401", "404", "409", "413")),
)


#: Below this temperature sampling is greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5


def check_generation(path: str, raw: object) -> None:
    """Refuse a generation body the kit's model refuses (the body itself is forwarded as sent),
    and what vLLM refuses that Forge's engine would answer: several greedy choices (identical
    by definition), so that both engines behind the gateway refuse the same requests."""
    body: ChatCompletionBody | CompletionBody
    if path == "/v1/chat/completions":
        body = parse(ChatCompletionBody, raw)
        for i, message in enumerate(body.messages):
            message_parts(message, i)
    else:
        body = parse(CompletionBody, raw)
    check_sampling(body)
    if body.n > 1 and body.temperature is not None and body.temperature < GREEDY_TEMPERATURE:
        raise errors.ValidationError(
            "n", f"must be 1 when using greedy sampling (temperature 0), got {body.n}"
        )


def _schema_ref(components: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with the document described in the module docstring."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        error_ref = _schema_ref(components, ErrorBody)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for path, operations in doc.get("paths", {}).items():
            for method, operation in operations.items():
                body = REQUEST_BODIES.get((path, method))
                if body is not None:
                    operation["requestBody"] = {
                        "required": True,
                        "content": {"application/json": {"schema": _schema_ref(components, body)}},
                    }
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                codes = next((c for prefix, c in _ERRORS_BY_PREFIX if path.startswith(prefix)), ())
                for code in codes:
                    responses[code] = {
                        "description": _DESCRIPTIONS[code],
                        "content": {"application/json": {"schema": error_ref}},
                    }
                if body is not None and path != "/v1/embeddings":  # JSON, or SSE with "stream"
                    ok = responses.setdefault("200", {"description": "Successful Response"})
                    ok["content"] = {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    }
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]
