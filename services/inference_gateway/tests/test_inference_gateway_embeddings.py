"""``/v1/embeddings`` through the official ``openai`` SDK: the gateway in front of a real retriever
process whose embedder is the bundled MiniLM (the gateway imports no retriever code)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from forge_inference_gateway.embeddings import GrpcEmbedder
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.service import InferenceGateway
from forge_kit.http import HttpServer, make_app
from forge_kit.testing import ServiceProcess, base_env

from .conftest import ADMIN_TOKEN, API_KEY

pytestmark = pytest.mark.integration
SERVICE_TOKEN = "retriever-token"
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("embeddings")
    env = base_env("retriever", token=SERVICE_TOKEN, data_dir=root / "data", embedding_backend="torch")
    proc = ServiceProcess("forge_retriever", env=env, cwd=str(root), log_path=str(root / "log")).start(120)
    yield proc
    proc.stop()


@pytest.fixture
async def base_url(gateway: InferenceGateway, retriever: ServiceProcess) -> AsyncIterator[str]:
    embedder = GrpcEmbedder(retriever.grpc_target, SERVICE_TOKEN)
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN, embedder=embedder)
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}/v1"
    await server.stop()
    await embedder.close()


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60) as sdk:
        yield sdk


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_embeddings_of_a_list_with_usage(client: openai.AsyncOpenAI) -> None:
    texts = [
        "Aspirin lowers the risk of a heart attack.",
        "Aspirin prevents heart attacks.",
        "It rains in May.",
    ]
    reply = await client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model.endswith(MODEL)
    vectors = [d.embedding for d in reply.data]
    assert all(
        len(v) == 384 and math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-3) for v in vectors
    )
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2]) + 0.2
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(texts) * 2
    floats = await client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vectors[0], abs=1e-5)
    assert floats.usage.prompt_tokens < reply.usage.prompt_tokens


async def test_embedding_refusals_by_class(client: openai.AsyncOpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as token_ids:
        await client.embeddings.create(model=MODEL, input=[[101, 2023, 102]])
    assert token_ids.value.param == "input"
    with pytest.raises(openai.BadRequestError) as empty:
        await client.embeddings.create(model=MODEL, input=["fine", " "])
    assert empty.value.param == "input.1"
    with pytest.raises(openai.BadRequestError) as sized:
        await client.embeddings.create(model=MODEL, input="x", dimensions=128)
    assert sized.value.code == "unsupported_parameter" and sized.value.param == "dimensions"
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="text-embedding-3-small", input="x")
    async with openai.AsyncOpenAI(base_url=base_url, api_key="not-a-key", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.embeddings.create(model=MODEL, input="x")
