"""Inference gateway process: settings → database → replica pool → tenants → consumer and control
loop → gRPC + HTTP servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from forge.events.v1 import events_pb2
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_inference_gateway.api import GatewayInferenceApi
from forge_inference_gateway.caching.response_cache import ResponseCache
from forge_inference_gateway.config import InferenceGatewaySettings
from forge_inference_gateway.embeddings import GrpcEmbedder
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.rag.clients import GrpcReranker, GrpcRetriever
from forge_inference_gateway.rag.service import RagService
from forge_inference_gateway.replicas.autoscaling import Autoscaler
from forge_inference_gateway.replicas.pool import ReplicaPool
from forge_inference_gateway.replicas.upstream import ModelServerClient
from forge_inference_gateway.routing.admission import Admission
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.tenants.training_prompts import TrainingPrompts
from forge_inference_gateway.vector_stores.index import GrpcDocumentIndex
from forge_inference_gateway.vector_stores.service import VectorStores
from forge_kit.app import ServiceApp
from forge_kit.cache import make_cache
from forge_kit.events import topic_for

CONSUMER_GROUP = "inference_gateway"


async def main() -> None:
    settings = InferenceGatewaySettings()
    app = ServiceApp(settings)
    db = await app.open_database("inference_gateway.db", Path(__file__).parent / "migrations")
    cache = make_cache(settings.redis_url, app.name)
    token = settings.model_server_token.get_secret_value()
    pool = ReplicaPool(
        settings.replica_urls(), lambda url: ModelServerClient(url, token), settings.routing_policy()
    )
    admission = Admission(pool, settings.admission_policy())
    gateway = InferenceGateway(
        db,
        cache,
        pool,
        admission=admission,
        autoscaler=Autoscaler(admission, settings.autoscale_policy()),
        responses=(
            ResponseCache(cache, settings.response_cache_ttl_s, settings.response_cache_max_bytes)
            if settings.response_cache_ttl_s > 0
            else None
        ),
        upstream_priority=settings.upstream_priority,
        upstream_attempts=settings.upstream_attempts,
        default_rpm_limit=settings.default_rpm_limit,
        request_timeout_s=settings.request_timeout_s,
        internal_token=app.token,
        alias_ttl_s=settings.alias_cache_ttl_s,
        tenant_ttl_s=settings.tenant_cache_ttl_s,
        metrics_interval_s=settings.metrics_interval_s,
        replica_sync_s=settings.replica_sync_s,
        training_prompts=TrainingPrompts(
            db,
            max_chars=settings.training_prompt_max_chars,
            max_per_tenant=settings.training_prompts_max_per_tenant,
        ),
    )
    await gateway.tenants.bootstrap(settings.bootstrap_api_key.get_secret_value())
    retriever = GrpcRetriever(settings.retriever_target, settings.retriever_token.get_secret_value())
    reranker = (
        GrpcReranker(settings.reranker_target, settings.reranker_token.get_secret_value())
        if settings.reranker_target
        else None
    )
    rag = RagService(gateway, retriever, reranker, cache, settings.rag_limits())
    app.add_on_stop(retriever.close)
    embedder = GrpcEmbedder(settings.retriever_target, settings.retriever_token.get_secret_value())
    app.add_on_stop(embedder.close)
    index = GrpcDocumentIndex(settings.retriever_target, settings.retriever_token.get_secret_value())
    stores = VectorStores(db, index, settings.document_limits())
    await stores.resume()
    app.add_on_stop(index.close)
    app.add_on_stop(stores.close)
    if reranker is not None:
        app.add_on_stop(reranker.close)
    app.add_background(gateway.replicas.run_control_loop)
    app.add_background(gateway.keys.run_flush_loop)
    app.add_on_stop(gateway.keys.flush)
    app.add_on_stop(gateway.replicas.stop)
    app.add_on_stop(gateway.shadows.close)
    if settings.kafka_enabled:
        app.event_consumer(
            group_id=CONSUMER_GROUP,
            topics=[topic_for(events_pb2.ModelPromoted())],
            handler=gateway.aliases.apply_model_promoted,
        )
    app.add_on_stop(cache.close)
    http = app.http_app()
    install_gateway_api(http, gateway, app.token, rag, embedder, stores)
    await app.run(
        register=[
            lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(
                GatewayInferenceApi(gateway), s
            )
        ],
        service_names=[inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name],
        http=http,
    )


if __name__ == "__main__":
    asyncio.run(main())
