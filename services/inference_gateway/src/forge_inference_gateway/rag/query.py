"""Step 1 of a RAG request: its limits, and the validated query (``POST /v1/rag/query``, or a chat
completion's ``retrieval`` object); a bad field is a ``ValidationError`` naming it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from forge_kit import errors
from forge_kit.limits import RAG_MAX_QUERY_CHARS
from forge_kit.validate import check_finite, check_printable_name


@dataclass(frozen=True)
class RagLimits:
    """Defaults and bounds of a RAG request (from the gateway's settings)."""

    timeout_s: float = 30.0
    max_query_chars: int = RAG_MAX_QUERY_CHARS
    default_top_k: int = 20
    max_top_k: int = 200
    default_top_n: int = 5
    max_top_n: int = 50
    default_context_tokens: int = 2048
    max_context_tokens: int = 32768
    default_max_tokens: int = 256
    retrieval_timeout_s: float = 2.0
    rerank_timeout_s: float = 1.0
    rerank_min_s: float = 0.05
    answer_reserve_s: float = 2.0
    chars_per_token: float = 3.0
    fit_rounds: int = 4
    cache_ttl_s: float = 60.0


@dataclass(frozen=True)
class RagQuery:
    """A validated ``POST /v1/rag/query`` body."""

    query: str
    collection: str
    model: str
    top_k: int
    top_n: int
    max_context_tokens: int
    max_tokens: int
    temperature: float
    stream: bool
    filter: dict[str, str]
    timeout_s: float


def _int(body: Mapping[str, object], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.ValidationError(name, "must be an integer")
    if not low <= value <= high:
        raise errors.ValidationError(name, f"must be between {low} and {high}, got {value}")
    return value


def parse_query(body: object, limits: RagLimits) -> RagQuery:
    """The validated request, or ``ValidationError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise errors.ValidationError("body", "must be a JSON object")
    unknown = set(body) - {f for f in RagQuery.__dataclass_fields__}
    if unknown:
        raise errors.ValidationError(sorted(unknown)[0], "unknown field")
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise errors.ValidationError("query", "is required and must not be empty")
    if len(query) > limits.max_query_chars:
        raise errors.ValidationError("query", f"must be at most {limits.max_query_chars} characters")
    collection = body.get("collection")
    if not isinstance(collection, str) or not collection.strip():
        raise errors.ValidationError("collection", "is required")
    model = check_printable_name("model", body.get("model"))
    top_k = _int(body, "top_k", limits.default_top_k, 1, limits.max_top_k)
    top_n = _int(body, "top_n", min(limits.default_top_n, top_k), 1, min(limits.max_top_n, top_k))
    context = _int(body, "max_context_tokens", limits.default_context_tokens, 16, limits.max_context_tokens)
    max_tokens = _int(body, "max_tokens", limits.default_max_tokens, 1, 32768)
    temperature = body.get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
        raise errors.ValidationError("temperature", "must be a number between 0 and 2")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise errors.ValidationError("stream", "must be a boolean")
    raw_filter = body.get("filter") or {}
    if not isinstance(raw_filter, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw_filter.items()
    ):
        raise errors.ValidationError("filter", "must be an object of string keys to string values")
    timeout = check_finite("timeout_s", body.get("timeout_s", limits.timeout_s), low=0, low_open=True)
    return RagQuery(
        query=query.strip(),
        collection=collection.strip(),
        model=model.strip(),
        top_k=top_k,
        top_n=top_n,
        max_context_tokens=context,
        max_tokens=max_tokens,
        temperature=float(temperature),
        stream=stream,
        filter=dict(raw_filter),
        timeout_s=min(float(timeout), limits.timeout_s),
    )


#: What a chat completion's ``retrieval`` object may hold (the RAG query fields it sets).
CHAT_RETRIEVAL_FIELDS = ("collection", "top_k", "top_n", "filter", "max_context_tokens")
#: Chat completion fields served together with ``retrieval``.
_CHAT_FIELDS = {"model", "messages", "max_tokens", "temperature", "stream", "retrieval", "user"}


def parse_chat(body: object, limits: RagLimits) -> tuple[RagQuery, list[dict[str, str]]]:
    """A chat completion with a ``retrieval`` object as a RAG query on its last user message, and
    the conversation before that message; ``ValidationError`` names the field."""
    if not isinstance(body, dict):
        raise errors.ValidationError("body", "must be a JSON object")
    retrieval = body.get("retrieval")
    if not isinstance(retrieval, dict):
        raise errors.ValidationError("retrieval", "must be an object with at least a collection")
    for name in sorted(set(retrieval) - set(CHAT_RETRIEVAL_FIELDS)):
        raise errors.ValidationError(f"retrieval.{name}", "unknown field")
    for name in sorted(set(body) - _CHAT_FIELDS):
        raise errors.ValidationError(name, "is not supported together with retrieval")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise errors.ValidationError("messages", "must be a non-empty list")
    history: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise errors.ValidationError(f"messages[{i}]", "must have a string role and string content")
        history.append({"role": message["role"], "content": message["content"]})
    question = history.pop()
    if question["role"] != "user":
        raise errors.ValidationError("messages", "the last message must be the user's question")
    fields = {k: body[k] for k in ("model", "max_tokens", "temperature", "stream") if k in body}
    try:
        query = parse_query({**retrieval, **fields, "query": question["content"]}, limits)
    except errors.ValidationError as exc:
        if exc.field == "query":
            raise errors.ValidationError(f"messages[{len(history)}].content", exc.message) from None
        if exc.field in CHAT_RETRIEVAL_FIELDS:
            raise errors.ValidationError(f"retrieval.{exc.field}", exc.message) from None
        raise
    return query, history
