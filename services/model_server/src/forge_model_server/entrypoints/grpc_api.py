"""gRPC servicer of ``forge.inference.v1.InferenceService`` on one model server: translation only."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from forge.common.v1 import common_pb2
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_model_server.service import ChatMessage, GenerationChunk, GenerationRequest, ModelServer

_FINISH = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "cancelled": inference_pb2.FINISH_REASON_CANCELLED,
}
# The proto's admission classes map onto vLLM's priority field (lower runs first).
_PRIORITY = {inference_pb2.PRIORITY_HIGH: -1, inference_pb2.PRIORITY_LOW: 1}


def request_from_proto(request: inference_pb2.GenerateRequest) -> GenerationRequest:
    generation = GenerationRequest(
        model=request.model,
        prompt=request.prompt if not request.messages else None,
        messages=[ChatMessage(m.role, m.content) for m in request.messages] or None,
        max_tokens=request.max_tokens or None,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
        seed=request.seed if request.HasField("seed") else None,
        stop=list(request.stop),
        priority=_PRIORITY.get(request.priority, 0),
    )
    if request.messages and request.prompt:
        generation.prompt = request.prompt  # both set: let validation name the conflict
    if request.request_id:
        generation.request_id = request.request_id
    return generation


def chunk_to_proto(
    chunk: GenerationChunk, ref: common_pb2.ModelRef, request_id: str
) -> inference_pb2.GenerateResponse:
    reply = inference_pb2.GenerateResponse(
        text_delta=chunk.text, token_ids=list(chunk.token_ids), model=ref, request_id=request_id
    )
    if chunk.finish_reason is not None:
        reply.finish_reason = _FINISH[chunk.finish_reason]
        reply.usage.CopyFrom(
            common_pb2.Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens)
        )
    return reply


class InferenceApi(inference_pb2_grpc.InferenceServiceServicer):
    """Generate and ListModels over the models of this replica."""

    def __init__(self, server: ModelServer) -> None:
        self._server = server

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        generation = request_from_proto(request)
        info, chunks = await self._server.generate(generation)
        ref = common_pb2.ModelRef(name=info.name, version=info.version)
        try:
            async for chunk in chunks:
                yield chunk_to_proto(chunk, ref, generation.request_id)
        finally:
            await chunks.aclose()

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ServedModel(
                    ref=common_pb2.ModelRef(name=m.name, version=m.version),
                    traffic_percent=100,
                    max_context_tokens=m.max_context_tokens,
                    ready_replicas=1 if self._server.is_loaded(m) else 0,
                )
                for m in self._server.list_models()
            ]
        )
