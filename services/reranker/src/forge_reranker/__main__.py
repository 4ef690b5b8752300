"""Reranker process: settings → scorer and score cache → gRPC + HTTP servers (no database)."""

from __future__ import annotations

import asyncio

from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

from forge_kit.app import ServiceApp
from forge_kit.cache import make_cache
from forge_reranker.api import RerankerApi
from forge_reranker.config import RerankerSettings
from forge_reranker.scoring import CrossEncoderScorer, LexicalScorer, Scorer
from forge_reranker.service import RerankerService


async def main() -> None:
    settings = RerankerSettings()
    app = ServiceApp(settings)
    cache = make_cache(settings.redis_url, app.name)
    app.add_on_stop(cache.close)
    scorer: Scorer
    if settings.scorer == "cross-encoder":
        scorer = await asyncio.to_thread(
            CrossEncoderScorer,
            settings.cross_encoder_path,
            max_tokens=settings.cross_encoder_max_tokens,
            batch_size=settings.cross_encoder_batch_size,
            int8=settings.cross_encoder_int8,
            num_threads=settings.torch_threads,
        )
    else:
        scorer = LexicalScorer(k1=settings.bm25_k1, b=settings.bm25_b, phrase_bonus=settings.phrase_bonus)
    service = RerankerService(scorer, cache, settings)
    if not scorer.batch_dependent:
        # A passage as long as the model reads: the pace is planned from the slow end.
        await service.warm_up(settings.cross_encoder_batch_size, "warm " * settings.cross_encoder_max_tokens)
    api = RerankerApi(service)
    await app.run(
        register=[lambda server: rerank_pb2_grpc.add_RerankerServiceServicer_to_server(api, server)],
        service_names=[rerank_pb2.DESCRIPTOR.services_by_name["RerankerService"].full_name],
    )


if __name__ == "__main__":
    asyncio.run(main())
