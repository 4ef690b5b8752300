"""Model server process: settings → model directory → service → gRPC + OpenAI HTTP servers."""

from __future__ import annotations

import asyncio

from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_kit.app import ServiceApp
from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_model_server.api import InferenceApi
from forge_model_server.config import ModelServerSettings
from forge_model_server.openai_api import install_openai_api
from forge_model_server.service import ModelDirectory, ModelServer


async def main() -> None:
    settings = ModelServerSettings()
    app = ServiceApp(settings)
    store = ObjectStore(settings.models_dir)
    server = ModelServer(ModelDirectory(store))

    async def directory_readable() -> bool:
        return await asyncio.to_thread(lambda: bool(store.fs.isdir(store.root)))

    http = make_app(app.name, readiness={"models_dir": directory_readable})
    install_openai_api(http, server, app.token)
    server.list_models()  # metric series of every model exist from the first scrape
    await app.run(
        register=[
            lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceApi(server), s)
        ],
        service_names=[inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name],
        http=http,
    )


if __name__ == "__main__":
    asyncio.run(main())
