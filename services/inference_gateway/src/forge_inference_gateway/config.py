"""Inference gateway settings (env prefix ``FORGE_INFERENCE_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator

from forge_inference_gateway.rag.query import RagLimits
from forge_inference_gateway.replicas.autoscaling import AutoscalePolicy
from forge_inference_gateway.replicas.pool import RoutingPolicy, normalize_url
from forge_inference_gateway.routing.admission import AdmissionPolicy
from forge_inference_gateway.vector_stores.service import DocumentLimits
from forge_kit import errors
from forge_kit.limits import OPENAI_MAX_BODY_BYTES, RAG_MAX_QUERY_CHARS
from forge_kit.settings import ServiceSettings, service_config


class InferenceGatewaySettings(ServiceSettings):
    """Settings of the inference gateway process."""

    model_config = service_config("inference_gateway")

    grpc_port: int = Field(default=50053, ge=0, le=65535)
    """gRPC port of the public InferenceService."""

    http_port: int = Field(default=8080, ge=0, le=65535)
    """HTTP port of the public OpenAI-compatible API, the admin API, probes and metrics."""

    http_max_body_bytes: int = Field(default=OPENAI_MAX_BODY_BYTES, ge=1024)
    """Largest HTTP request body accepted (a long chat fits); 413 in the OpenAI format beyond."""

    model_server_url: str = "http://127.0.0.1:8000"
    """Base URLs of the model-server replicas (Forge ``model_server`` or ``vllm serve``), comma
    separated; more can be added and removed at run time through the admin API. Empty: none
    configured, the pool holds only what the admin API adds (a deployment's replicas)."""

    model_server_token: SecretStr = SecretStr("")
    """Bearer token the gateway presents to the model servers (vLLM's ``--api-key``)."""

    upstream_priority: bool = True
    """Send each request's admission level as vLLM's ``priority`` (0 interactive, 1 batch), which a
    vLLM started with ``--scheduling-policy priority`` schedules by (Forge starts it so); turn off for
    an engine that refuses the field (vLLM 0.32.0 without the policy accepts it and ignores it)."""

    bootstrap_api_key: SecretStr = SecretStr("")
    """API key of the ``default`` tenant, created or re-keyed at start-up; empty: no bootstrap tenant."""

    default_rpm_limit: int = Field(default=600, ge=1)
    """Requests per minute allowed to the bootstrap tenant and to tenants created without a limit."""

    training_prompt_max_chars: int = Field(default=4000, ge=1, le=100_000)
    """Longest prompt of an opted-in tenant recorded for the RLHF prompt pool; longer ones are skipped."""

    training_prompts_max_per_tenant: int = Field(default=10_000, ge=0, le=10_000_000)
    """Prompts recorded per opted-in tenant at most; once reached, no more are recorded."""

    request_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one inference request, end to end, queueing included; what is left of it is
    passed upstream."""

    metrics_interval_s: float = Field(default=0.5, gt=0)
    """How often every replica's ``/metrics`` is scraped (queue depth, KV-cache use)."""

    scrape_timeout_s: float = Field(default=1.0, gt=0)
    """Timeout of one scrape; a replica that does not answer in time counts a failure."""

    models_refresh_s: float = Field(default=10.0, gt=0)
    """How often each replica's ``/v1/models`` is read to learn what it serves."""

    replica_sync_s: float = Field(default=5.0, gt=0)
    """How often the replicas added through the admin API are re-read from the database."""

    max_inflight_per_replica: int = Field(default=64, ge=1)
    """Requests one replica may run at once (about its ``--max-num-seqs``); beyond it requests queue
    at the gateway, in priority order."""

    interactive_reserve: float = Field(default=0.25, ge=0, lt=1)
    """Share of each replica's slots that batch requests may not take."""

    kv_high: float = Field(default=0.95, gt=0, le=1)
    """KV-cache use above which a replica takes no more batch requests."""

    kv_weight: float = Field(default=1.0, ge=0)
    """Weight of KV-cache use against load (both 0-1) in a replica's routing score."""

    affinity_slack: float = Field(default=0.25, ge=0)
    """How much worse than the least-loaded replica's score the prefix-affine replica's may be and
    still win (0.25: a quarter of ``max_inflight_per_replica`` more requests)."""

    affinity_block_chars: int = Field(default=64, ge=1)
    """Prompt characters per prefix block in the affinity index."""

    affinity_max_blocks: int = Field(default=32, ge=0)
    """Leading blocks of a prompt the affinity index looks at; 0 turns prefix affinity off."""

    eject_after_failures: int = Field(default=2, ge=1)
    """Failures in a row (scrapes or connections) after which a replica is taken out of routing."""

    eject_base_s: float = Field(default=2.0, gt=0)
    """First back-off of an ejected replica before it is probed again; doubles on each failed probe."""

    eject_max_s: float = Field(default=60.0, gt=0)
    """Longest back-off of an ejected replica."""

    upstream_attempts: int = Field(default=2, ge=1)
    """Replicas tried for one request when a replica cannot be reached or is full (429/503)."""

    max_queue_per_model: int = Field(default=256, ge=0)
    """Requests that may wait for a slot per model; beyond it the lowest priority is shed (429)."""

    shed_retry_after_s: float = Field(default=2.0, gt=0)
    """``Retry-After`` of a request shed from a full queue."""

    response_cache_ttl_s: float = Field(default=300.0, ge=0)
    """How long an answer to a deterministic request (temperature 0 or a seed) is replayed; 0 turns
    the response cache off."""

    response_cache_max_bytes: int = Field(default=1 << 20, ge=0)
    """Largest answer the response cache stores."""

    alias_cache_ttl_s: float = Field(default=1.0, ge=0)
    """How long a resolved alias is reused before the database is read again (changes made by this
    process apply at once)."""

    tenant_cache_ttl_s: float = Field(default=5.0, ge=0)
    """How long an authenticated API key is reused before the database is read again."""

    autoscale_target_per_replica: float = Field(default=16.0, gt=0)
    """Requests (queued + running) one replica should carry; the load term of desired replicas."""

    autoscale_ttft_slo_s: float = Field(default=2.0, gt=0)
    """Time-to-first-token SLO (p99); the latency term of desired replicas."""

    autoscale_min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas the autoscaling signal asks for."""

    autoscale_max_replicas: int = Field(default=16, ge=1)
    """Most replicas the autoscaling signal asks for."""

    retriever_target: str = "127.0.0.1:50055"
    """``host:port`` of the retriever (``forge.retrieval.v1.RetrieverService``) behind ``/v1/rag/query``."""

    retriever_token: SecretStr = SecretStr("")
    """Service token presented to the retriever; the gateway names the caller's tenant in ``forge-tenant``."""

    reranker_target: str = "127.0.0.1:50056"
    """``host:port`` of the reranker (``forge.rerank.v1.RerankerService``); empty: RAG keeps retriever order."""

    reranker_token: SecretStr = SecretStr("")
    """Service token presented to the reranker."""

    rag_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one RAG query, retrieval to last token; a request's ``timeout_s`` may only shorten it."""

    rag_retrieval_timeout_s: float = Field(default=2.0, gt=0)
    """Longest the retriever's Search may take within a RAG query's deadline."""

    rag_rerank_timeout_s: float = Field(default=1.0, gt=0)
    """Longest the reranker may take; past it the retriever's order is kept and the answer says so."""

    rag_rerank_min_s: float = Field(default=0.05, ge=0)
    """Reranking is skipped (retriever order, said in the answer) when less than this is left for it."""

    rag_answer_reserve_s: float = Field(default=2.0, ge=0)
    """Part of the deadline that reranking never eats into: it is kept for generating the answer."""

    rag_max_query_chars: int = Field(default=RAG_MAX_QUERY_CHARS, ge=1)
    """Longest RAG query (``/v1/rag/query``, a chat's last message with ``retrieval``, a vector-store
    search), in characters: the RAG path's one limit, ``forge_kit.limits.RAG_MAX_QUERY_CHARS``,
    which the retriever and the reranker take too."""

    rag_default_top_k: int = Field(default=20, ge=1)
    """Chunks retrieved when the request gives no ``top_k``."""

    rag_max_top_k: int = Field(default=200, ge=1)
    """Largest ``top_k`` a RAG request may ask for."""

    rag_default_top_n: int = Field(default=5, ge=1)
    """Passages kept after reranking when the request gives no ``top_n``."""

    rag_max_top_n: int = Field(default=50, ge=1)
    """Largest ``top_n`` a RAG request may ask for (never more than its ``top_k``)."""

    rag_default_context_tokens: int = Field(default=2048, ge=16)
    """Token budget of the prompt (passages, instructions, question) when the request gives none."""

    rag_max_context_tokens: int = Field(default=32768, ge=16)
    """Largest ``max_context_tokens`` a request may ask for; the model's ``max_model_len`` caps it too."""

    rag_default_max_tokens: int = Field(default=256, ge=1)
    """Answer tokens when the request gives no ``max_tokens``."""

    rag_chars_per_token: float = Field(default=3.0, gt=0)
    """Characters counted as one token when fitting the context (the model's tokenizer is not local to
    the gateway); 3 is conservative for English on BPE vocabularies of 32k or more, lower it for
    byte-level or small-vocabulary tokenizers."""

    rag_cache_ttl_s: float = Field(default=60.0, ge=0)
    """How long a greedy RAG answer is replayed for the same tenant, collection, query, parameters
    and model version; 0 turns the RAG cache off."""

    docs_max_vector_stores: int = Field(default=100, ge=1)
    """Vector stores one tenant may hold (``POST /v1/vector_stores``); 403 ``quota_exceeded`` beyond."""

    docs_max_documents: int = Field(default=10_000, ge=1)
    """Documents (attached files and upserted texts) one tenant may hold over all its stores."""

    docs_max_bytes: int = Field(default=100 << 20, ge=1)
    """Bytes one tenant may store: uploaded files plus upserted texts (UTF-8)."""

    docs_max_file_bytes: int = Field(default=1 << 20, ge=1)
    """Largest file ``POST /v1/files`` takes (413 beyond); keep it under ``http_max_body_bytes``."""

    docs_max_batch_documents: int = Field(default=100, ge=1, le=1000)
    """Documents one ``POST /v1/vector_stores/{id}/documents`` may carry (the retriever takes 1,000)."""

    docs_max_batch_bytes: int = Field(default=2 << 20, ge=1)
    """Text bytes one ``POST /v1/vector_stores/{id}/documents`` may carry (413 beyond)."""

    docs_index_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one retriever write (a file's indexing, a batch, a delete)."""

    @model_validator(mode="after")
    def _ranges(self) -> InferenceGatewaySettings:
        if self.autoscale_min_replicas > self.autoscale_max_replicas:
            raise ValueError("autoscale_min_replicas must not exceed autoscale_max_replicas")
        if self.eject_base_s > self.eject_max_s:
            raise ValueError("eject_base_s must not exceed eject_max_s")
        for url in self.replica_urls():
            try:
                normalize_url(url)
            except errors.ValidationError as exc:
                raise ValueError(f"model_server_url: {exc.message.removeprefix('url: ')}") from None
        return self

    def replica_urls(self) -> list[str]:
        return [u.strip() for u in self.model_server_url.split(",") if u.strip()]

    def routing_policy(self) -> RoutingPolicy:
        return RoutingPolicy(
            max_inflight=self.max_inflight_per_replica,
            reserve=self.interactive_reserve,
            kv_high=self.kv_high,
            kv_weight=self.kv_weight,
            affinity_slack=self.affinity_slack,
            block_chars=self.affinity_block_chars,
            max_blocks=self.affinity_max_blocks,
            eject_after=self.eject_after_failures,
            eject_base_s=self.eject_base_s,
            eject_max_s=self.eject_max_s,
            scrape_timeout_s=self.scrape_timeout_s,
            models_refresh_s=self.models_refresh_s,
        )

    def rag_limits(self) -> RagLimits:
        return RagLimits(
            timeout_s=self.rag_timeout_s,
            max_query_chars=self.rag_max_query_chars,
            default_top_k=self.rag_default_top_k,
            max_top_k=self.rag_max_top_k,
            default_top_n=self.rag_default_top_n,
            max_top_n=self.rag_max_top_n,
            default_context_tokens=self.rag_default_context_tokens,
            max_context_tokens=self.rag_max_context_tokens,
            default_max_tokens=self.rag_default_max_tokens,
            retrieval_timeout_s=self.rag_retrieval_timeout_s,
            rerank_timeout_s=self.rag_rerank_timeout_s,
            rerank_min_s=self.rag_rerank_min_s,
            answer_reserve_s=self.rag_answer_reserve_s,
            chars_per_token=self.rag_chars_per_token,
            cache_ttl_s=self.rag_cache_ttl_s,
        )

    def document_limits(self) -> DocumentLimits:
        return DocumentLimits(
            max_vector_stores=self.docs_max_vector_stores,
            max_documents=self.docs_max_documents,
            max_bytes=self.docs_max_bytes,
            max_file_bytes=self.docs_max_file_bytes,
            max_batch_documents=self.docs_max_batch_documents,
            max_batch_bytes=self.docs_max_batch_bytes,
            max_query_chars=self.rag_max_query_chars,
            index_timeout_s=self.docs_index_timeout_s,
            search_timeout_s=max(self.rag_retrieval_timeout_s, 10.0),
        )

    def admission_policy(self) -> AdmissionPolicy:
        return AdmissionPolicy(max_queue=self.max_queue_per_model, retry_after_s=self.shed_retry_after_s)

    def autoscale_policy(self) -> AutoscalePolicy:
        return AutoscalePolicy(
            target_per_replica=self.autoscale_target_per_replica,
            ttft_slo_s=self.autoscale_ttft_slo_s,
            min_replicas=self.autoscale_min_replicas,
            max_replicas=self.autoscale_max_replicas,
        )
