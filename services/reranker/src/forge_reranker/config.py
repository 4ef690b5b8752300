"""Reranker settings (env prefix ``FORGE_RERANKER_``)."""

from __future__ import annotations

from pydantic import Field

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

    max_query_chars: int = Field(default=2048, ge=1)
    """Longest query accepted, in characters."""

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
