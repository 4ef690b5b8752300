"""Retriever process: settings → database → embedder → index (rebuilt if stale) → servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from forge.events.v1 import events_pb2
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.app import ServiceApp
from forge_kit.events import topic_for
from forge_kit.http import make_app
from forge_retriever.api import RetrieverApi, document_change_handler
from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import embedder_for
from forge_retriever.index import QdrantEdgeIndex, VectorIndex
from forge_retriever.index_server import CollectionLayout, QdrantServerIndex
from forge_retriever.indexing import sparse_encoder
from forge_retriever.service import RetrieverService


async def main() -> None:
    settings = RetrieverSettings()
    app = ServiceApp(settings)
    db = await app.open_database("retriever.db", Path(__file__).parent / "migrations")
    relay = app.enable_outbox()
    embedder = None
    if settings.dense_enabled:
        embedder = await asyncio.to_thread(embedder_for, settings)
    dense_dim = embedder.dimension if embedder else None
    dense_version = embedder.version if embedder else ""
    sparse_version = sparse_encoder(settings).version
    index: VectorIndex = (
        QdrantServerIndex.connect(
            settings.qdrant_url,
            settings.qdrant_api_key.get_secret_value(),
            prefix=settings.qdrant_collection_prefix,
            layout=CollectionLayout(
                shards=settings.qdrant_shards,
                replication_factor=settings.qdrant_replication_factor,
                write_consistency_factor=settings.qdrant_write_consistency_factor,
                on_disk_payload=settings.qdrant_on_disk_payload,
                on_disk_vectors=settings.qdrant_on_disk_vectors,
                quantization=settings.qdrant_quantization,
                oversampling=settings.qdrant_oversampling,
            ),
            dense_dim=dense_dim,
            dense_version=dense_version,
            sparse_version=sparse_version,
        )
        if settings.index_backend == "qdrant"
        else QdrantEdgeIndex(Path(settings.data_dir) / "index", dense_dim, dense_version, sparse_version)
    )
    app.add_on_stop(lambda: asyncio.to_thread(index.close))
    service = RetrieverService(
        db,
        index,
        settings,
        embedder=embedder,
        producer=app.name,
        on_commit=relay.wake if relay else lambda: None,
    )
    await service.reconcile_index()
    if settings.kafka_enabled and settings.consume_document_changes:
        topic = topic_for(events_pb2.DocumentChanged())
        app.event_consumer(
            group_id=app.name,
            topics=[topic],
            handler=document_change_handler(service),
            sources={topic: settings.document_sources},
        )

    async def index_ready() -> bool:
        return service.index_ready

    await app.run(
        register=[
            lambda server: retrieval_pb2_grpc.add_RetrieverServiceServicer_to_server(
                RetrieverApi(service), server
            )
        ],
        service_names=[retrieval_pb2.DESCRIPTOR.services_by_name["RetrieverService"].full_name],
        http=make_app(app.name, readiness={"database": db.ping, "index": index_ready}),
    )


if __name__ == "__main__":
    asyncio.run(main())
