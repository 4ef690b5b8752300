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
5. **Assemble** the context (:func:`~forge_inference_gateway.rag.context.assemble_context`): drop repeated and overlapping chunk text,
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

The parts live beside this module in the ``rag`` package: ``query`` (step 1), ``clients`` (the
retriever and reranker, steps 3-4), ``context`` (step 5); this one runs them in order.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field

import structlog
from prometheus_client import Counter, Histogram

from forge_inference_gateway.rag.clients import Candidate, Reranker, Retriever
from forge_inference_gateway.rag.context import Passage, assemble_context, cited
from forge_inference_gateway.rag.query import RagLimits, RagQuery, parse_chat, parse_query
from forge_inference_gateway.routing.aliases import Alias
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.tenants.registry import Tenant
from forge_kit import errors
from forge_kit.cache import Cache
from forge_kit.modelref import ModelRef

log = structlog.get_logger(__name__)

RAG_REQUESTS = Counter("forge_gateway_rag_requests_total", "RAG queries answered", ["outcome"])
RAG_STAGE_SECONDS = Histogram(
    "forge_gateway_rag_stage_seconds",
    "Time spent in each RAG stage",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)


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


#: A measured prompt holding at least this fraction of the budget is full enough.
FIT_LOW = 0.9


def _chars_counter(chars_per_token: float) -> Callable[[str], int]:
    """Token count of a text estimated as ``ceil(characters / chars_per_token)``."""
    return lambda text: math.ceil(len(text) / chars_per_token)


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

    def _cache_key(
        self, tenant: Tenant, query: RagQuery, target: ModelRef, alias: Alias | None
    ) -> str | None:
        if self._cache is None or self.limits.cache_ttl_s <= 0 or query.temperature != 0:
            return None
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
        # 2. Cache (keyed by the model version ``model`` resolves to now, and its canary split).
        model, alias = await self._gateway.router.resolve(query.model)
        plan.cache_key = None if history else self._cache_key(tenant, query, model, alias)
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
        reranked = self._clock()
        RAG_STAGE_SECONDS.labels("rerank").observe(reranked - retrieved)
        # 5. Assemble within the token budget.
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
            query.query, ranked, budget, model, plan.deadline
        )
        plan.messages = [*history, {"role": "user", "content": prompt}]
        RAG_STAGE_SECONDS.labels("assemble").observe(self._clock() - reranked)
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
        self,
        query: str,
        ranked: list[tuple[Candidate, float]],
        budget: int,
        target: ModelRef,
        deadline: float,
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
                log.info("rag.token_count_timed_out", target=str(target))
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
