"""``docs/QUICKSTART.md`` runs: every ``python`` and ``bash`` block, in order, as a product app
would run it, against a gateway in front of real retriever (dense embeddings on), reranker and
model_server processes, with a tenant key. A block that fails, or prints an error, fails the test."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from forge_inference_gateway.embeddings import GrpcEmbedder
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.rag.clients import GrpcReranker, GrpcRetriever
from forge_inference_gateway.rag.query import RagLimits
from forge_inference_gateway.rag.service import RagService
from forge_inference_gateway.vector_stores.index import GrpcDocumentIndex
from forge_inference_gateway.vector_stores.service import VectorStores
from forge_kit.cache import InMemoryCache
from forge_kit.db import Database
from forge_kit.http import HttpServer, make_app
from forge_kit.testing import ServiceProcess

from .conftest import ADMIN_TOKEN, build_gateway
from .test_inference_gateway_rag import SERVICE_TOKEN, UPSTREAM_TOKEN, _service, save_tiny_llama

pytestmark = pytest.mark.integration
QUICKSTART = Path(__file__).parents[3] / "docs" / "QUICKSTART.md"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(QUICKSTART.read_text())]


@pytest.fixture(scope="module")
def platform_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceProcess]]:
    root = tmp_path_factory.mktemp("quickstart")
    save_tiny_llama(root / "models" / "llama")
    procs = {
        "retriever": _service("retriever", root),
        "reranker": _service("reranker", root),
        "model_server": _service(
            "model_server", root, token=UPSTREAM_TOKEN, models_dir=str(root / "models"), torch_threads="1"
        ),
    }
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.start(180), procs.values()))
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture
async def live(platform_services: dict[str, ServiceProcess], db: Database) -> AsyncIterator[dict[str, str]]:
    """The environment the quick start's blocks read: a live gateway and a fresh tenant's key."""
    retriever_target = platform_services["retriever"].grpc_target
    gateway = build_gateway(db, [platform_services["model_server"].http_url], request_timeout_s=120)
    retriever = GrpcRetriever(retriever_target, SERVICE_TOKEN)
    reranker = GrpcReranker(platform_services["reranker"].grpc_target, SERVICE_TOKEN)
    embedder = GrpcEmbedder(retriever_target, SERVICE_TOKEN, timeout_s=60)
    index = GrpcDocumentIndex(retriever_target, SERVICE_TOKEN)
    stores = VectorStores(db, index)
    # Generous retrieval and rerank budgets: the first calls pay every service's cold start.
    limits = RagLimits(retrieval_timeout_s=30.0, rerank_timeout_s=30.0, answer_reserve_s=1.0, timeout_s=120.0)
    rag = RagService(gateway, retriever, reranker, InMemoryCache(), limits)
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN, rag, embedder, stores)
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    _, key = await gateway.tenants.create_tenant("quickstart", rpm_limit=1000)
    try:
        yield {
            "FORGE_BASE_URL": f"http://127.0.0.1:{server.port}/v1",
            "FORGE_API_KEY": key,
            "FORGE_MODEL": "llama",
        }
    finally:
        await server.stop()
        await stores.close()
        for client in (index, embedder, retriever, reranker):
            await client.close()
        await gateway.replicas.stop()


async def run_block(kind: str, code: str, env: dict[str, str], cwd: Path) -> str:
    command = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
    proc = await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    text = out.decode()
    assert proc.returncode == 0, f"{kind} block failed:\n{code}\n--- output ---\n{text}"
    return text


def test_the_quickstart_has_every_section_with_runnable_blocks() -> None:
    text = QUICKSTART.read_text()
    for section in (
        "Get a key",
        "Chat",
        "Stream",
        "Embed",
        "Load documents",
        "Ask a RAG question",
        "Handle errors",
    ):
        assert f"## {section}" in text
    kinds = [kind for kind, _ in blocks()]
    assert kinds.count("python") >= 6 and kinds.count("bash") >= 2


async def test_every_quickstart_block_runs_against_a_live_platform(
    live: dict[str, str], tmp_path: Path
) -> None:
    env = {**live, "FORGE_STORE_FILE": str(tmp_path / "store_id.txt")}
    outputs = []
    for kind, code in blocks():
        output = await run_block(kind, code, env, tmp_path)
        assert '"error"' not in output, f"{kind} block answered an error:\n{code}\n{output}"
        outputs.append(output)
    everything = "\n".join(outputs)
    # What the blocks printed shows they did what the page says.
    assert everything.count(" completed None") == 3, everything
    assert "all-MiniLM-L6-v2" in everything or "minilm" in everything.lower(), everything
    assert "bad request: 400" in everything and "unauthenticated: 401" in everything
    assert re.search(r"^1 file-\w+ ", everything, re.M), everything  # a passage from an uploaded file
    # What the key did is counted against it: requests, the tokens of chats and answers, documents.
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {live['FORGE_API_KEY']}"}) as http:
        keys = (await http.get(live["FORGE_BASE_URL"] + "/keys")).json()["data"]
    assert [k["name"] for k in keys] == ["primary"] and keys[0]["prefix"] == live["FORGE_API_KEY"][:10]
    usage = keys[0]["usage"]
    assert usage["requests"] >= 10 and usage["tokens"] > 0 and usage["documents"] == 4, usage
