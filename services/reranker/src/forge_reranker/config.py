"""Reranker settings (env prefix ``FORGE_RERANKER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from forge_kit.limits import RAG_MAX_QUERY_CHARS
from forge_kit.settings import ServiceSettings, service_config


class RerankerSettings(ServiceSettings):
    """Settings of the reranker process."""

    model_config = service_config("reranker")

    grpc_port: int = Field(default=50056, ge=0, le=65535)
    """gRPC port of the RerankerService."""

    http_port: int = Field(default=8056, ge=0, le=65535)
    """HTTP port for health and metrics."""

    max_passages: int = Field(default=256, ge=1)
    """Most passages one Rerank call may carry."""

    max_query_chars: int = Field(default=RAG_MAX_QUERY_CHARS, ge=1)
    """Longest query accepted, in characters: the RAG path's one limit
    (``forge_kit.limits.RAG_MAX_QUERY_CHARS``), so whatever the retriever searched can be reranked."""

    max_passage_chars: int = Field(default=20_000, ge=1)
    """Longest passage accepted, in characters."""

    score_cache_ttl_s: float = Field(default=3600.0, gt=0)
    """How long a computed score stays in the cache."""

    bm25_k1: float = Field(default=1.2, ge=0.0)
    """BM25 term-frequency saturation of the lexical scorer."""

    bm25_b: float = Field(default=0.75, ge=0.0, le=1.0)
    """BM25 length normalisation of the lexical scorer (0: none, 1: full)."""

    phrase_bonus: float = Field(default=1.0, ge=0.0)
    """Added to a passage's score when it contains the whole query as a phrase (scaled down for
    the share of the query's word pairs it contains)."""

    scorer: Literal["lexical", "cross-encoder"] = "lexical"
    """Which scorer serves: the lexical BM25+phrase scorer, or the cross-encoder in ``cross_encoder_path``."""

    cross_encoder_path: str = ""
    """Hugging Face cross-encoder directory (config.json, weights, tokenizer); required for ``cross-encoder``."""

    cross_encoder_max_tokens: int = Field(default=256, ge=16, le=512)
    """Word pieces per (query, passage) pair; the passage is truncated to fit."""

    cross_encoder_batch_size: int = Field(default=16, ge=1, le=256)
    """Pairs per forward pass."""

    cross_encoder_int8: bool = True
    """Dynamically quantise the cross-encoder's Linear layers to INT8 (about 2x faster on CPU)."""

    deadline_margin_ms: float = Field(default=10.0, ge=0)
    """Time kept back from a call's deadline for ordering and the reply: scoring stops before it."""

    retrieval_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of the caller's ``retrieval_score`` in the order when every scored passage has one
    (both min-max normalised over the call); 0 orders by the model alone. 0.5 was best on NFCorpus's
    dev split for Forge's cross-encoder over the hybrid first stage (load/retrieval/RESULTS.md)."""

    torch_threads: int = Field(default=0, ge=0)
    """Torch CPU threads for the cross-encoder; 0 keeps torch's default (one per core)."""

    @model_validator(mode="after")
    def _cross_encoder_needs_a_path(self) -> RerankerSettings:
        if self.scorer == "cross-encoder" and not self.cross_encoder_path:
            raise ValueError("cross_encoder_path is required when scorer is 'cross-encoder'")
        return self
