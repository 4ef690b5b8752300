"""gRPC servicer of ``forge.rerank.v1.RerankerService``: translation only."""

from __future__ import annotations

import grpc
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

from forge_reranker.service import PassageIn, RerankerService


class RerankerApi(rerank_pb2_grpc.RerankerServiceServicer):
    def __init__(self, service: RerankerService) -> None:
        self._service = service

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        passages = [
            PassageIn(p.id, p.text, p.retrieval_score if p.HasField("retrieval_score") else None)
            for p in request.passages
        ]
        answer = await self._service.rerank(
            request.query, passages, request.top_n, request.model, time_left_s=context.time_remaining()
        )
        return rerank_pb2.RerankResponse(
            results=[
                rerank_pb2.RankedPassage(
                    id=r.id, score=r.score, index=r.index, scored=r.scored, model_score=r.model_score
                )
                for r in answer.passages
            ],
            model=self._service.model,
            partial=answer.partial,
            scored=answer.scored,
        )
