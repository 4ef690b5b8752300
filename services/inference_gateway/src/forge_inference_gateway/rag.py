"""Retrieval-augmented answers (``POST /v1/rag/query``): retrieve → rerank → assemble → generate.

:meth:`RagService.prepare` runs steps 1-5, :meth:`RagService.answer` / :meth:`RagService.stream` step 6:

1. **Validate** the request (400 naming the field) and start its deadline: the gateway's
   ``rag_timeout_s``, or the request's ``timeout_s`` when sooner. Every call below gets what is
   left of it as its gRPC timeout (or HTTP deadline).
2. **Cache**: a greedy request (``temperature`` 0) whose answer is in the cache, keyed by tenant,
   collection, query, every parameter and the model version the alias resolves to, is replayed.
3. **Retrieve** the hybrid top-``top_k`` chunks from the retriever, acting for the caller's tenant
   (gRPC metadata ``forge-tenant`` = the API key's tenant name): the retriever enforces the
   isolation, whatever ``filter`` says. Unknown collection → 400; retriever down → 503.
4. **Rerank** to ``top_n`` with the cross-encoder, with at most ``rag_rerank_timeout_s`` and never
   eating into ``rag_answer_reserve_s``: the reranker scores candidates in retriever order while
   that budget lasts and keeps the retriever's order for the rest (``rerank.partial``, with how
   many were ``scored``); when it is unavailable, fails, or the deadline is too near to start,
   the retriever's order is kept and the response says so (``rerank.skipped``).
5. **Assemble** the context (:func:`assemble_context`): drop repeated and overlapping chunk text,
   keep the reranked order, fit the token budget, number the passages ``[1]..[n]`` and ask for
   citations.
6. **Generate** through the gateway's own completion path (aliases, canaries, admission, routing,
   response cache), streamed as SSE when asked; the response names the passages and which of them
   the answer cites.

Token counting: the context budget is in tokens of the serving model, counted by a replica that
serves it (``POST /tokenize``, vLLM's route, which Forge's model_server answers too) on the whole
chat as the model will see it, template included. Assembly itself counts with a
characters-per-token ratio, ``rag_chars_per_token`` (default 3) at first and then the ratio the
replica's count showed, until the count fits (:meth:`RagService._fit`); the budget is also capped
by the model's ``max_model_len``. A replica without the route leaves the estimate in place, and
every response says which under ``context.token_count``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from prometheus_client import Counter, Histogram

from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.tenants import Tenant
from forge_inference_gateway.upstream import UpstreamError, UpstreamUnavailableError
from forge_kit import errors
from forge_kit.cache import Cache
from forge_kit.grpckit import FIELD_METADATA_KEY, make_channel
from forge_kit.validate import check_finite, check_printable_name

log = structlog.get_logger(__name__)

#: gRPC request metadata naming the tenant the gateway acts for (the retriever's ``tenancy.py``).
TENANT_METADATA_KEY = "forge-tenant"
_CITATION = re.compile(r"\[(\d+(?:\s*,\s*\d+)*)\]")
_WORD = re.compile(r"\S+")
#: Overlap shorter than this many words is coincidence, not a shared chunk boundary.
_MIN_OVERLAP_WORDS = 5

RAG_REQUESTS = Counter("forge_gateway_rag_requests_total", "RAG queries answered", ["outcome"])
RAG_STAGE_SECONDS = Histogram(
    "forge_gateway_rag_stage_seconds",
    "Time spent in each RAG stage",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)


@dataclass(frozen=True)
class RagLimits:
    """Defaults and bounds of a RAG request (from the gateway's settings)."""

    timeout_s: float = 30.0
    max_query_chars: int = 2048
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


@dataclass(frozen=True)
class Candidate:
    """A retrieved chunk (step 3), in retriever order."""

    document_id: str
    chunk_id: str
    text: str
    score: float
    metadata: dict[str, str]


@dataclass(frozen=True)
class Passage:
    """A chunk placed in the context as ``[n]``; ``text`` is what the model saw (overlap trimmed)."""

    n: int
    document_id: str
    chunk_id: str
    text: str
    score: float
    metadata: dict[str, str]

    def view(self) -> dict[str, object]:
        return {
            "n": self.n,
            "document_id": self.document_id,
            "chunk_id": self.chunk_id,
            "score": self.score,
            "metadata": self.metadata,
        }


@dataclass
class RagPlan:
    """What steps 1-5 decided; step 6 turns it into an answer. ``cached`` is a replayed answer."""

    query: RagQuery
    tenant: Tenant
    deadline: float
    messages: list[dict[str, str]] = field(default_factory=list)
    passages: list[Passage] = field(default_factory=list)
    report: dict[str, object] = field(default_factory=dict)
    cache_key: str | None = None
    cached: dict[str, object] | None = None


class Retriever(Protocol):
    """The retriever as the RAG service calls it in step 3, once per query."""

    async def search(self, tenant: str, query: RagQuery, timeout_s: float) -> tuple[list[Candidate], str]:
        """The top ``query.top_k`` chunks best first, and how they were scored (``hybrid``, ``sparse``)."""
        ...


@dataclass(frozen=True)
class RerankAnswer:
    """What the reranker returned: ``order`` is ``(index into candidates, score)`` best first, at
    most ``top_n``; with ``partial`` only ``scored`` candidates were scored before the deadline
    and the rest follow in retriever order."""

    order: list[tuple[int, float]]
    model: str
    partial: bool = False
    scored: int = 0


class Reranker(Protocol):
    """The reranker as the RAG service calls it in step 4, once per query with candidates."""

    async def rerank(
        self, query: str, candidates: Sequence[Candidate], top_n: int, timeout_s: float
    ) -> RerankAnswer:
        """The candidates reranked within ``timeout_s`` (the deadline the reranker plans for)."""
        ...


def _metadata(metadata: Iterable[Any] | None, key: str) -> str | None:
    """The first value of ``key`` in gRPC metadata (``grpc.aio.Metadata`` or a tuple of pairs)."""
    for item in metadata or ():
        if item[0] == key:
            value = item[1]
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def _grpc_error(service: str, exc: grpc.aio.AioRpcError) -> Exception:
    """The domain error a failed retriever/reranker call stands for."""
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field_name = _metadata(exc.trailing_metadata(), FIELD_METADATA_KEY) or "request"
        prefix = f"{field_name}: "
        return errors.ValidationError(field_name, details.removeprefix(prefix))
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"{service} did not answer within the deadline")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return UpstreamUnavailableError(f"{service} unavailable: {details}")
    if code is grpc.StatusCode.NOT_FOUND:
        return errors.NotFoundError(details)
    log.warning("rag.downstream_failed", service=service, code=code.name, details=details)
    return UpstreamError(f"{service} failed ({code.name})")


class GrpcRetriever:
    """``forge.retrieval.v1.RetrieverService`` with the gateway's service token."""

    def __init__(self, target: str, token: str | None) -> None:
        self._channel = make_channel(target, token=token, max_attempts=2, initial_backoff_s=0.05)
        self._stub = retrieval_pb2_grpc.RetrieverServiceStub(self._channel)

    async def search(self, tenant: str, query: RagQuery, timeout_s: float) -> tuple[list[Candidate], str]:
        request = retrieval_pb2.SearchRequest(
            collection=query.collection,
            query=query.query,
            top_k=query.top_k,
            mode=retrieval_pb2.SEARCH_MODE_HYBRID,
            filter=query.filter,
        )
        call = self._stub.Search(request, timeout=timeout_s, metadata=((TENANT_METADATA_KEY, tenant),))
        try:
            reply = await call
            trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            raise _grpc_error("retriever", exc) from None
        mode = _metadata(trailing, "forge-search-mode") or "hybrid"
        return [
            Candidate(c.document_id, c.chunk_id, c.text, c.score, dict(c.metadata)) for c in reply.chunks
        ], mode

    async def close(self) -> None:
        await self._channel.close(None)


class GrpcReranker:
    """``forge.rerank.v1.RerankerService`` with the gateway's service token."""

    def __init__(self, target: str, token: str | None) -> None:
        # One quick retry at most: a reranker that is down is skipped, not waited for.
        self._channel = make_channel(target, token=token, max_attempts=2, initial_backoff_s=0.01)
        self._stub = rerank_pb2_grpc.RerankerServiceStub(self._channel)

    async def rerank(
        self, query: str, candidates: Sequence[Candidate], top_n: int, timeout_s: float
    ) -> RerankAnswer:
        request = rerank_pb2.RerankRequest(
            query=query,
            passages=[
                rerank_pb2.Passage(id=str(i), text=c.text, retrieval_score=c.score)
                for i, c in enumerate(candidates)
            ],
            top_n=top_n,
        )
        try:
            reply = await self._stub.Rerank(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _grpc_error("reranker", exc) from None
        return RerankAnswer(
            [(int(r.index), float(r.score)) for r in reply.results],
            reply.model,
            partial=reply.partial,
            scored=int(reply.scored),
        )

    async def close(self) -> None:
        await self._channel.close(None)


# -- step 1: validation --------------------------------------------------------------------------


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


# -- step 5: context assembly --------------------------------------------------------------------


def _trim_overlap(kept: str, text: str) -> str:
    """``text`` without the words it shares with ``kept`` at a chunk boundary (either side)."""
    a, b = kept.split(), text.split()
    for k in range(min(len(a), len(b)), _MIN_OVERLAP_WORDS - 1, -1):
        if a[-k:] == b[:k]:  # text continues kept
            return " ".join(b[k:])
        if b[-k:] == a[:k]:  # text leads into kept
            return " ".join(b[:-k])
    return text


PROMPT_HEAD = (
    "Answer the question using only the numbered passages. Cite the passages you use as [n]. "
    "If they do not contain the answer, say so.\n\n"
)


def render_prompt(query: str, passages: Sequence[tuple[int, str, str]]) -> str:
    """The user turn: instructions, ``[n] title: text`` per passage, then the question."""
    blocks = [f"[{n}] {title + ': ' if title else ''}{text}" for n, title, text in passages]
    return PROMPT_HEAD + "\n\n".join(blocks) + f"\n\nQuestion: {query}"


def assemble_context(
    query: str,
    ranked: Sequence[tuple[Candidate, float]],
    budget_tokens: int,
    count_tokens: Callable[[str], int],
) -> tuple[list[Passage], str]:
    """Numbered passages and the prompt that holds them, within ``budget_tokens``.

    1. In ranked order, drop a chunk already placed (same id or same text) or contained in a
       placed chunk, and trim the words a chunk shares with a placed chunk of the same document
       (neighbouring chunks overlap by design);
    2. add passages while the whole prompt stays within the budget; a passage that does not fit
       is skipped and smaller ones after it may still fit; the first passage is cut to fit rather
       than leaving the context empty.
    """
    placed: list[Passage] = []
    seen_ids: set[str] = set()
    for candidate, score in ranked:
        if candidate.chunk_id in seen_ids:
            continue
        text = " ".join(candidate.text.split())
        for p in placed:
            if text in p.text:
                text = ""
                break
            if p.document_id == candidate.document_id:
                text = _trim_overlap(p.text, text)
        if not text:
            continue
        title = candidate.metadata.get("title", "")
        trial = [(q.n, q.metadata.get("title", ""), q.text) for q in placed]
        trial.append((len(placed) + 1, title, text))
        if count_tokens(render_prompt(query, trial)) > budget_tokens:
            if placed:
                continue
            room = budget_tokens - count_tokens(render_prompt(query, [(1, title, "")]))
            if room <= 0:
                break
            words = text.split()
            while words and count_tokens(render_prompt(query, [(1, title, " ".join(words))])) > budget_tokens:
                words = words[: max(0, min(len(words) - 1, int(len(words) * 0.9)))]
            text = " ".join(words)
            if not text:
                break
        seen_ids.add(candidate.chunk_id)
        placed.append(
            Passage(
                len(placed) + 1, candidate.document_id, candidate.chunk_id, text, score, candidate.metadata
            )
        )
    prompt = render_prompt(query, [(p.n, p.metadata.get("title", ""), p.text) for p in placed])
    return placed, prompt


#: A measured prompt holding at least this fraction of the budget is full enough.
FIT_LOW = 0.9


def _chars_counter(chars_per_token: float) -> Callable[[str], int]:
    """Token count of a text estimated as ``ceil(characters / chars_per_token)``."""
    return lambda text: math.ceil(len(text) / chars_per_token)


def cited(answer: str, passages: Sequence[Passage]) -> list[Passage]:
    """The passages ``answer`` cites as ``[n]`` or ``[n, m]``, in order of first citation."""
    by_n = {p.n: p for p in passages}
    out: list[Passage] = []
    for match in _CITATION.finditer(answer):
        for part in match.group(1).split(","):
            p = by_n.get(int(part))
            if p is not None and p not in out:
                out.append(p)
    return out


class RagService:
    """Steps 1-6 of the module docstring, for the HTTP route."""

    def __init__(
        self,
        gateway: InferenceGateway,
        retriever: Retriever,
        reranker: Reranker | None,
        cache: Cache | None,
        limits: RagLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._gateway = gateway
        self._retriever = retriever
        self._reranker = reranker
        self._cache = cache
        self.limits = limits or RagLimits()
        self._clock = clock

    def _left(self, deadline: float) -> float:
        left = deadline - self._clock()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        return left

    async def _cache_key(self, tenant: Tenant, query: RagQuery) -> str | None:
        if self._cache is None or self.limits.cache_ttl_s <= 0 or query.temperature != 0:
            return None
        target, alias = await self._gateway.aliases.resolve_model(query.model)
        version = (
            [str(target), alias.canary_target, alias.canary_weight] if alias is not None else [str(target)]
        )
        params = {**asdict(query), "stream": None, "timeout_s": None, "version": version}
        digest = hashlib.sha256(json.dumps([tenant.id, params], sort_keys=True).encode()).hexdigest()
        return f"rag:{digest}"

    def _model_context(self, model: str) -> int | None:
        """``max_model_len`` a healthy replica reports for ``model``, if any."""
        for replica in self._gateway.pool.replicas():
            card = (replica.cards or {}).get(model) if replica.healthy else None
            length = card.get("max_model_len") if card else None
            if isinstance(length, int) and length > 0:
                return length
        return None

    async def prepare(self, tenant: Tenant, body: object) -> RagPlan:
        """Steps 1-5 for ``POST /v1/rag/query``."""
        # 1. Validate; the deadline starts now.
        return await self.plan(tenant, parse_query(body, self.limits))

    async def prepare_chat(self, tenant: Tenant, body: object) -> RagPlan:
        """Steps 1-5 for a chat completion with ``retrieval``: the last user message is the
        question, the conversation before it goes to the model ahead of the assembled prompt, and
        its length (estimated at ``chars_per_token``) comes off the context budget. A
        conversation with history is not cached (the answer depends on it)."""
        query, history = parse_chat(body, self.limits)
        reserve = sum(-(-len(m["content"]) // max(1, round(self.limits.chars_per_token))) for m in history)
        return await self.plan(tenant, query, history=history, reserve_tokens=reserve)

    async def plan(
        self,
        tenant: Tenant,
        query: RagQuery,
        *,
        history: Sequence[dict[str, str]] = (),
        reserve_tokens: int = 0,
    ) -> RagPlan:
        """Steps 2-5 for a validated query."""
        plan = RagPlan(query, tenant, self._gateway.deadline(query.timeout_s))
        started = self._clock()
        # 2. Cache.
        plan.cache_key = None if history else await self._cache_key(tenant, query)
        if plan.cache_key is not None and self._cache is not None:
            hit = await self._cache.get(plan.cache_key)
            if hit is not None:
                plan.cached = json.loads(hit)
                RAG_REQUESTS.labels("cached").inc()
                return plan
        # 3. Retrieve for the caller's tenant.
        timeout = min(self.limits.retrieval_timeout_s, self._left(plan.deadline))
        candidates, mode = await self._retriever.search(tenant.name, query, timeout)
        retrieved = self._clock()
        RAG_STAGE_SECONDS.labels("retrieve").observe(retrieved - started)
        # 4. Rerank, or keep the retriever's order and say why.
        ranked, rerank = await self._rerank(query, candidates, plan.deadline)
        RAG_STAGE_SECONDS.labels("rerank").observe(self._clock() - retrieved)
        # 5. Assemble within the token budget.
        model, _ = await self._gateway.aliases.resolve_model(query.model)
        target = str(model)
        await self._gateway.pool.ensure_known()
        budget = query.max_context_tokens
        model_len = self._model_context(model.name)
        if model_len is not None:
            budget = min(budget, model_len - query.max_tokens - reserve_tokens)
            if budget < 16:
                field_name = "messages" if reserve_tokens else "max_tokens"
                raise errors.ValidationError(
                    field_name, f"leaves no room for context in the model's {model_len}-token window"
                )
        plan.passages, prompt, tokens, method = await self._fit(
            query.query, ranked, budget, target, plan.deadline
        )
        plan.messages = [*history, {"role": "user", "content": prompt}]
        plan.report = {
            "retrieval": {"mode": mode, "candidates": len(candidates), "top_k": query.top_k},
            "rerank": rerank,
            "context": {
                "passages": len(plan.passages),
                "tokens": tokens,
                "budget_tokens": budget,
                "token_count": method,
            },
            "timings_ms": {
                "retrieve": round((retrieved - started) * 1000, 1),
                "rerank_and_assemble": round((self._clock() - retrieved) * 1000, 1),
            },
        }
        return plan

    async def _fit(
        self, query: str, ranked: list[tuple[Candidate, float]], budget: int, target: str, deadline: float
    ) -> tuple[list[Passage], str, int, str]:
        """Step 5: passages and prompt within ``budget`` tokens of the serving model, the prompt's
        token count, and how it was counted.

        Assembly counts with a characters-per-token ratio (the conservative ``chars_per_token`` at
        first); the assembled chat is then counted by a replica with the model's own tokenizer and
        template (``/tokenize``), and assembly runs again with the ratio that prompt showed (and, once
        that ratio still overshoots, a budget lowered by the excess), at most ``fit_rounds`` counts, keeping the fullest
        prompt that fits. Without a replica that counts, the estimate stands.
        """
        ratio, aim = self.limits.chars_per_token, budget
        best: tuple[list[Passage], str, int] | None = None
        measured_any = timed_out = False
        for _ in range(self.limits.fit_rounds):
            passages, prompt = assemble_context(query, ranked, aim, _chars_counter(ratio))
            if best is not None and prompt == best[1]:
                break  # the corrected ratio places nothing more
            try:
                measured = await self._gateway.count_tokens(
                    target, [{"role": "user", "content": prompt}], min(deadline, self._clock() + 2.0)
                )
            except TimeoutError:
                # A count slower than its 2 s (a replica's first /tokenize on a busy machine) is
                # a replica that did not count: the best prompt so far, or the estimate, stands.
                # The request's own deadline is checked again before the answer.
                log.info("rag.token_count_timed_out", target=target)
                timed_out = True
                break
            if measured is None:
                break
            measured_any = True
            if measured <= budget and (best is None or measured > best[2]):
                best = (passages, prompt, measured)
            if FIT_LOW * budget <= measured <= budget:
                break
            if measured > budget and ratio != self.limits.chars_per_token:
                # Already assembled with a measured ratio: the text varies; aim lower by the excess.
                aim = max(1, aim - (measured - budget))
            ratio = len(prompt) / max(measured, 1)
        if best is not None:
            return *best, "measured: the serving model's tokenizer and chat template (/tokenize on a replica)"
        if measured_any and not timed_out:
            raise errors.ValidationError(
                "max_context_tokens",
                f"{budget} tokens of the serving model cannot hold the instructions and the question",
            )
        count = _chars_counter(self.limits.chars_per_token)
        passages, prompt = assemble_context(query, ranked, budget, count)
        if count(prompt) > budget:
            raise errors.ValidationError(
                "max_context_tokens", f"{budget} tokens cannot hold the instructions and the question"
            )
        return (
            passages,
            prompt,
            count(prompt),
            f"estimated: ceil(characters / {self.limits.chars_per_token:g}); no replica counted it"
            + (" in time" if timed_out else ""),
        )

    async def _rerank(
        self, query: RagQuery, candidates: list[Candidate], deadline: float
    ) -> tuple[list[tuple[Candidate, float]], dict[str, object]]:
        in_order = [(c, c.score) for c in candidates]
        if not candidates:
            return [], {"applied": False, "skipped": "no candidates"}
        if self._reranker is None:
            return in_order[: query.top_n], {"applied": False, "skipped": "no reranker configured"}
        budget = min(self.limits.rerank_timeout_s, deadline - self._clock() - self.limits.answer_reserve_s)
        if budget < self.limits.rerank_min_s:
            reason = f"deadline: {max(0.0, budget) * 1000:.0f} ms left for reranking"
            return in_order[: query.top_n], {"applied": False, "skipped": reason}
        try:
            answer = await self._reranker.rerank(query.query, candidates, query.top_n, budget)
        except (TimeoutError, errors.ForgeError) as exc:
            log.info("rag.rerank_skipped", error=str(exc))
            return in_order[: query.top_n], {"applied": False, "skipped": f"reranker: {exc}"}
        ranked = [(candidates[i], score) for i, score in answer.order if 0 <= i < len(candidates)]
        report: dict[str, object] = {"applied": True, "model": answer.model}
        if answer.partial:
            # The reranker scored what its deadline allowed; the rest kept the retriever's order.
            report.update(partial=True, scored=answer.scored, candidates=len(candidates))
        return ranked[: query.top_n], report

    def _result(self, plan: RagPlan, model: str, answer: str, usage: dict[str, int]) -> dict[str, object]:
        length = usage.get("completion_tokens", 0) >= plan.query.max_tokens
        return {
            "id": f"rag-{uuid.uuid4().hex[:16]}",
            "object": "rag.answer",
            "model": model,
            "answer": answer,
            "finish_reason": "length" if length else "stop",
            "citations": [p.view() for p in cited(answer, plan.passages)],
            "passages": [p.view() for p in plan.passages],
            **plan.report,
            "usage": usage,
            "cached": False,
        }

    async def _store(self, plan: RagPlan, result: dict[str, object]) -> None:
        rerank = plan.report.get("rerank")
        degraded = isinstance(rerank, dict) and str(rerank.get("skipped", "")).startswith(
            ("reranker", "deadline")
        )
        if plan.cache_key is not None and self._cache is not None and not degraded:
            await self._cache.set(plan.cache_key, json.dumps(result).encode(), self.limits.cache_ttl_s)

    async def _generate(self, plan: RagPlan) -> AsyncIterator[tuple[str, str, dict[str, int] | None]]:
        """(model version, text piece, usage on the last piece) from the completion path."""
        body: dict[str, object] = {
            "model": plan.query.model,
            "messages": plan.messages,
            "max_tokens": plan.query.max_tokens,
            "temperature": plan.query.temperature,
        }
        async for model, chunk in self._gateway.generate(
            plan.tenant, body, chat=True, deadline=plan.deadline
        ):
            usage = None
            if chunk.finish_reason is not None:
                usage = {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens}
            yield str(model), chunk.text, usage

    async def answer(self, plan: RagPlan) -> dict[str, object]:
        """Step 6, whole."""
        if plan.cached is not None:
            return {**plan.cached, "cached": True}
        started = self._clock()
        model, pieces, usage = plan.query.model, [], dict[str, int]()
        async for served, text, last in self._generate(plan):
            model = served
            pieces.append(text)
            usage = last or usage
        RAG_STAGE_SECONDS.labels("generate").observe(self._clock() - started)
        result = self._result(plan, model, "".join(pieces), usage)
        await self._store(plan, result)
        RAG_REQUESTS.labels("answered").inc()
        return result

    async def stream(self, plan: RagPlan) -> AsyncIterator[dict[str, object]]:
        """Step 6, streamed: ``rag.answer.delta`` events, then the whole result as ``rag.answer``."""
        if plan.cached is not None:
            yield {"object": "rag.answer.delta", "delta": plan.cached.get("answer", "")}
            yield {**plan.cached, "cached": True}
            return
        model, pieces, usage = plan.query.model, [], dict[str, int]()
        async for served, text, last in self._generate(plan):
            model = served
            if text:
                pieces.append(text)
                yield {"object": "rag.answer.delta", "delta": text}
            usage = last or usage
        result = self._result(plan, model, "".join(pieces), usage)
        await self._store(plan, result)
        RAG_REQUESTS.labels("streamed").inc()
        yield result
