"""Model server process: settings → model directory → service → gRPC + OpenAI HTTP servers."""

from __future__ import annotations

import asyncio

import torch
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_kit.app import ServiceApp
from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_model_server.config import ModelServerSettings
from forge_model_server.engine.async_engine import HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.entrypoints.admin_api import install_admin_api
from forge_model_server.entrypoints.grpc_api import InferenceApi
from forge_model_server.entrypoints.image_inputs import ImagePolicy
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.entrypoints.safe_fetch import parse_networks
from forge_model_server.service import ModelDirectory, ModelServer


async def main() -> None:
    settings = ModelServerSettings()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    app = ServiceApp(settings)
    store = ObjectStore(settings.models_dir)
    engine_config = EngineConfig(
        num_blocks=settings.num_kv_blocks,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
    )
    loader = HFEngineLoader(
        engine_config,
        max_waiting=settings.max_waiting_requests,
        decode_attention=settings.decode_attention,
        max_image_pixels=settings.image_max_pixels,
    )
    images = ImagePolicy(
        max_bytes=settings.image_max_bytes,
        max_images=settings.image_max_per_request,
        fetch_urls=settings.image_url_fetch,
        url_timeout_s=settings.image_url_timeout_s,
        allowed_networks=parse_networks(settings.image_url_allowed_networks),
    )
    server = ModelServer(ModelDirectory(store), loader=loader, drain_timeout_s=settings.drain_timeout_s)
    # Runs after both servers stopped accepting and let their open calls finish.
    app.add_on_stop(lambda: server.drain(settings.drain_timeout_s))

    async def directory_readable() -> bool:
        return await asyncio.to_thread(lambda: bool(store.fs.isdir(store.root)))

    http = make_app(app.name, readiness={"models_dir": directory_readable})
    install_openai_api(http, server, app.token, images)
    install_admin_api(http, server, app.token)
    server.list_models()  # metric series of every model exist from the first scrape
    await server.preload(settings.preload)
    await app.run(
        register=[
            lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceApi(server), s)
        ],
        service_names=[inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name],
        http=http,
    )


if __name__ == "__main__":
    asyncio.run(main())
