"""gRPC servicer of the public ``forge.inference.v1.InferenceService``: translation only.

Callers authenticate with the service token (the kit's interceptor); the tenant charged is the
request's ``tenant`` field, ``default`` when empty. Generation goes through the same routing,
admission and cache as the HTTP API, to a model server's streaming HTTP API, and its server-sent
events are translated into ``GenerateResponse`` chunks; each names the model version that served it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
from forge.common.v1 import common_pb2
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_inference_gateway.replicas.upstream import UpstreamError, UpstreamUnavailableError
from forge_inference_gateway.service import InferenceGateway, StreamChunk
from forge_inference_gateway.tenants.registry import BOOTSTRAP_TENANT
from forge_kit import errors
from forge_kit.modelref import ModelRef
from forge_kit.validate import check_finite, check_seed

_FINISH = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "cancelled": inference_pb2.FINISH_REASON_CANCELLED,
    "abort": inference_pb2.FINISH_REASON_CANCELLED,
}
# vLLM's priority field: lower runs first.
_PRIORITY = {inference_pb2.PRIORITY_HIGH: -1, inference_pb2.PRIORITY_LOW: 1}


def openai_body(request: inference_pb2.GenerateRequest) -> tuple[dict[str, object], bool]:
    """The OpenAI JSON body of ``request`` and whether it is a chat request."""
    if not request.model.strip():
        raise errors.ValidationError("model", "is required")
    if request.messages and request.prompt:
        raise errors.ValidationError("messages", "give either prompt or messages, not both")
    if request.HasField("rag"):
        raise errors.ValidationError(
            "rag", "retrieval-augmented generation is not served by this gateway yet"
        )
    chat = bool(request.messages)
    body: dict[str, object] = {"model": request.model}
    if chat:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    else:
        body["prompt"] = request.prompt
    if request.max_tokens:
        body["max_tokens"] = request.max_tokens
    if request.HasField("temperature"):
        body["temperature"] = check_finite("temperature", request.temperature, low=0, high=2)
    if request.HasField("top_p"):
        body["top_p"] = check_finite("top_p", request.top_p, low=0, high=1, low_open=True)
    if request.HasField("seed"):
        body["seed"] = check_seed("seed", request.seed)
    if request.stop:
        body["stop"] = list(request.stop)
    body["priority"] = _PRIORITY.get(request.priority, 0)
    return body, chat


def ref_to_proto(model: ModelRef) -> common_pb2.ModelRef:
    return common_pb2.ModelRef(name=model.name, version=model.version)


def chunk_to_proto(
    chunk: StreamChunk, ref: common_pb2.ModelRef, request_id: str
) -> inference_pb2.GenerateResponse:
    reply = inference_pb2.GenerateResponse(text_delta=chunk.text, model=ref, request_id=request_id)
    if chunk.finish_reason is not None:
        reply.finish_reason = _FINISH.get(chunk.finish_reason, inference_pb2.FINISH_REASON_STOP)
        reply.usage.CopyFrom(
            common_pb2.Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens)
        )
    return reply


class GatewayInferenceApi(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, gateway: InferenceGateway) -> None:
        self._gateway = gateway

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        body, chat = openai_body(request)
        try:
            tenant = await self._gateway.tenants.tenant_named(request.tenant or BOOTSTRAP_TENANT)
        except errors.NotFoundError:
            raise errors.ValidationError("tenant", f"unknown tenant {request.tenant!r}") from None
        await self._gateway.tenants.admit(tenant)
        request_id = request.request_id or uuid.uuid4().hex
        deadline = self._gateway.deadline(context.time_remaining())
        try:
            async for model, chunk in self._gateway.generate(tenant, body, chat=chat, deadline=deadline):
                yield chunk_to_proto(chunk, ref_to_proto(model), request_id)
        except UpstreamUnavailableError as exc:
            context.set_trailing_metadata((("retry-after-ms", str(int(exc.retry_after_s * 1000))),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
        except UpstreamError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        try:
            cards = await self._gateway.list_models()
        except (UpstreamUnavailableError, UpstreamError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
        aliases: dict[str, list[str]] = {}
        # Share of an alias's traffic each model gets: a canary its weight, the stable the rest.
        traffic: dict[str, int] = {}
        for card in cards:
            if "alias_of" not in card:
                continue
            stable = ModelRef.parse(str(card["alias_of"])).name
            aliases.setdefault(stable, []).append(str(card["id"]))
            canary = card.get("canary")
            if isinstance(canary, dict):
                weight = int(canary["weight"])
                traffic[stable] = min(traffic.get(stable, 100), 100 - weight)
                canary_name = ModelRef.parse(str(canary["model"])).name
                aliases.setdefault(canary_name, []).append(str(card["id"]))
                traffic[canary_name] = max(traffic.get(canary_name, 0), weight)
        models = []
        for card in cards:
            if "alias_of" in card:
                continue
            name = str(card["id"])
            context_len = card.get("max_model_len")
            models.append(
                inference_pb2.ServedModel(
                    ref=common_pb2.ModelRef(name=name, version=str(card.get("version") or "")),
                    aliases=aliases.get(name, []),
                    traffic_percent=traffic.get(name, 100),
                    max_context_tokens=context_len if isinstance(context_len, int) else 0,
                    ready_replicas=int(str(card.get("ready_replicas", 0))),
                )
            )
        return inference_pb2.ListModelsResponse(models=models)
