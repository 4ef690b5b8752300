"""``/v1/files`` and ``/v1/vector_stores`` through the official ``openai`` SDK, in front of real
retriever, reranker and model_server processes: a tenant with only its API key creates a store,
uploads three files and polls them to ``completed``, searches them, and asks a RAG question whose
passages come from them; another tenant sees none of it; limits answer 4xx and a refused or
failed upload loses nothing already stored."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import typer
from typer.testing import CliRunner, Result

from forge_inference_gateway.admin_cli import rag_app, tenants_app
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.rag.clients import GrpcReranker, GrpcRetriever
from forge_inference_gateway.rag.query import RagLimits
from forge_inference_gateway.rag.service import RagService
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.vector_stores.index import GrpcDocumentIndex
from forge_inference_gateway.vector_stores.service import DocumentLimits, VectorStores
from forge_inference_gateway.vector_stores.values import check_attributes, index_value
from forge_kit import errors
from forge_kit.cache import InMemoryCache
from forge_kit.db import Database
from forge_kit.http import HttpServer, make_app
from forge_kit.limits import RAG_MAX_QUERY_CHARS
from forge_kit.testing import ServiceProcess

from .test_inference_gateway_rag import SERVICE_TOKEN, services  # noqa: F401 - the module's processes

ADMIN_TOKEN = "admin-token"
FILES = {
    "zebras.md": "Zebras have black and white stripes that confuse biting flies and predators.",
    "rockets.txt": "Acme ships rockets by mail; delivery to the desert takes three working days.",
    "migration.md": "The zebra migration crosses the Mara river every July, led by wildebeest herds.",
}


def test_attributes_follow_openais_rules() -> None:
    assert check_attributes("attributes", {"team": "a", "year": 2024, "draft": False}) == {
        "team": "a",
        "year": 2024,
        "draft": False,
    }
    for bad, field in (
        ({f"k{i}": "v" for i in range(17)}, "attributes"),
        ({"k": "v" * 513}, "attributes.k"),
        ({"filename": "x"}, "attributes.filename"),
        ({"k": [1]}, "attributes.k"),
        ({"k": float("nan")}, "attributes.k"),
    ):
        with pytest.raises(errors.ValidationError) as caught:
            check_attributes("attributes", bad)
        assert caught.value.field == field
    # Held as retriever metadata so that an eq filter on the typed value matches.
    assert [index_value(v) for v in ("a", 3, 2.5, True)] == ["a", "3", "2.5", "true"]


Platform = Callable[..., Awaitable[tuple[str, dict[str, str]]]]


@pytest.fixture
async def platform(
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    db: Database,
    services: dict[str, ServiceProcess],  # noqa: F811
) -> AsyncIterator[Platform]:
    """``base_url, keys = await platform(limits)``: the gateway's HTTP API on a free port over the
    real services, tenants ``acme`` and ``globex`` with their keys."""
    closers: list[Any] = []

    async def build(limits: DocumentLimits | None = None) -> tuple[str, dict[str, str]]:
        gateway = await make_gateway([services["model_server"].http_url], request_timeout_s=60)
        retriever = GrpcRetriever(services["retriever"].grpc_target, SERVICE_TOKEN)
        reranker = GrpcReranker(services["reranker"].grpc_target, SERVICE_TOKEN)
        index = GrpcDocumentIndex(services["retriever"].grpc_target, SERVICE_TOKEN)
        stores = VectorStores(db, index, limits or DocumentLimits())
        rag_limits = RagLimits(
            chars_per_token=1.0, answer_reserve_s=1.0, default_max_tokens=8, retrieval_timeout_s=10.0
        )
        rag = RagService(gateway, retriever, reranker, InMemoryCache(), rag_limits)
        app = make_app("inference_gateway")
        install_gateway_api(app, gateway, ADMIN_TOKEN, rag, None, stores)
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        closers.extend((server.stop, stores.close, index.close, retriever.close, reranker.close))
        keys = {
            name: (await gateway.tenants.create_tenant(name, rpm_limit=1000))[1]
            for name in ("acme", "globex")
        }
        return f"http://127.0.0.1:{server.port}/v1", keys

    yield build
    for close in reversed(closers):
        await close()


def sdk(base_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


@pytest.mark.integration
async def test_a_tenant_loads_files_searches_them_and_asks_over_them(platform: Platform) -> None:
    base_url, keys = await platform()
    async with sdk(base_url, keys["acme"]) as acme, sdk(base_url, keys["globex"]) as globex:
        store = await acme.vector_stores.create(name="handbook", metadata={"team": "support"})
        assert store.id.startswith("vs_") and store.name == "handbook"
        uploaded = {}
        for name, text in FILES.items():
            done = await acme.vector_stores.files.upload_and_poll(
                vector_store_id=store.id,
                file=(name, io.BytesIO(text.encode()), "text/plain"),
                max_wait_seconds=120,
            )
            assert done.status == "completed" and done.last_error is None, done
            uploaded[done.id] = name
        listed = await acme.vector_stores.files.list(vector_store_id=store.id)
        assert {f.id for f in listed.data} == set(uploaded)
        again = await acme.vector_stores.retrieve(store.id)
        assert again.file_counts.completed == 3 and again.file_counts.total == 3
        assert again.usage_bytes == sum(len(t.encode()) for t in FILES.values())

        results = await acme.vector_stores.search(store.id, query="zebra stripes flies", max_num_results=2)
        hits = list(results.data)
        assert hits and hits[0].filename == "zebras.md", hits
        assert hits[0].file_id in uploaded and "stripes" in hits[0].content[0].text

        # A RAG question over the store: every passage comes from the uploaded files.
        async with httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=120
        ) as http:
            reply = await http.post(
                "/rag/query",
                json={
                    "query": "zebra migration river",
                    "vector_store_id": store.id,
                    "model": "llama",
                    "top_n": 2,
                },
            )
            assert reply.status_code == 200, reply.text
            passages = reply.json()["passages"]
            assert passages and {p["document_id"] for p in passages} <= set(uploaded)
            assert passages[0]["document_id"] == next(i for i, n in uploaded.items() if n == "migration.md")

        # Another tenant sees neither the store nor the files.
        with pytest.raises(openai.NotFoundError):
            await globex.vector_stores.retrieve(store.id)
        with pytest.raises(openai.NotFoundError):
            await globex.vector_stores.search(store.id, query="zebra")
        with pytest.raises(openai.NotFoundError):
            await globex.files.retrieve(next(iter(uploaded)))
        assert (await globex.vector_stores.list()).data == []

        # Detaching a file takes it out of search; deleting the store takes the rest.
        zebras = next(i for i, n in uploaded.items() if n == "zebras.md")
        deleted = await acme.vector_stores.files.delete(zebras, vector_store_id=store.id)
        assert deleted.deleted
        results = await acme.vector_stores.search(store.id, query="zebra stripes flies")
        assert zebras not in {h.file_id for h in results.data}
        assert (await acme.files.retrieve(zebras)).filename == "zebras.md"  # the file itself stays
        assert (await acme.vector_stores.delete(store.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await acme.vector_stores.retrieve(store.id)


@pytest.mark.integration
async def test_limits_answer_4xx_and_a_failed_upload_loses_nothing(platform: Platform) -> None:
    limits = DocumentLimits(max_vector_stores=1, max_documents=3, max_file_bytes=200, max_batch_documents=2)
    base_url, keys = await platform(limits)
    headers = {"Authorization": f"Bearer {keys['acme']}"}
    async with (
        sdk(base_url, keys["acme"]) as acme,
        httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as http,
    ):
        store = await acme.vector_stores.create(name="kb")
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await acme.vector_stores.create(name="second")
        assert caught.value.code == "quota_exceeded"

        docs = [
            {"id": "a", "text": "Aardvarks dig burrows at night."},
            {"id": "b", "text": "Badgers dig setts."},
        ]
        first = await http.post(f"/vector_stores/{store.id}/documents", json={"documents": docs})
        assert first.status_code == 200, first.text
        assert first.json()["upserted"] == 2
        # The same batch again is idempotent: nothing is written, nothing is added.
        same = await http.post(f"/vector_stores/{store.id}/documents", json={"documents": docs})
        assert same.json() == {"object": "vector_store.documents.batch", "upserted": 0, "unchanged": 2}

        # A batch with one bad document is refused whole, naming it; a batch past the limits is too.
        bad = await http.post(
            f"/vector_stores/{store.id}/documents",
            json={"documents": [{"id": "a", "text": "Aardvarks were replaced."}, {"id": "c", "text": " "}]},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents[1].text", bad.text
        many = await http.post(
            f"/vector_stores/{store.id}/documents",
            json={"documents": [{"id": f"x{i}", "text": "x"} for i in range(3)]},
        )
        assert many.status_code == 413, many.text
        over = await http.post(
            f"/vector_stores/{store.id}/documents",
            json={"documents": [{"id": "c", "text": "Cats."}, {"id": "d", "text": "Dogs."}]},
        )
        assert over.status_code == 403 and over.json()["error"]["code"] == "quota_exceeded", over.text

        # Files: too large is 413; bytes that are not text fail with the reason.
        with pytest.raises(openai.APIStatusError) as too_big:
            await acme.files.create(file=("big.txt", b"x" * 201), purpose="assistants")
        assert too_big.value.status_code == 413
        failed = await acme.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("blob.bin", b"\xff\xfe\x00binary"), max_wait_seconds=120
        )
        assert failed.status == "failed" and failed.last_error is not None
        assert failed.last_error.code == "unsupported_file", failed.last_error
        failures = await acme.vector_stores.files.list(vector_store_id=store.id, filter="failed")
        assert [f.id for f in failures.data] == [failed.id]

        # What was stored before every refusal is still there, unchanged.
        found = await acme.vector_stores.search(store.id, query="aardvarks burrows")
        assert [h.file_id for h in found.data][:1] == ["a"]
        assert "night" in found.data[0].content[0].text
        # Bad input names the field.
        long_query = await http.post(
            f"/vector_stores/{store.id}/search", json={"query": "q" * (RAG_MAX_QUERY_CHARS + 1)}
        )
        assert long_query.status_code == 400 and long_query.json()["error"]["param"] == "query"
        unknown = await http.post(f"/vector_stores/{store.id}/search", json={"query": "a", "rank": 1})
        assert unknown.status_code == 400, unknown.text


@pytest.mark.integration
async def test_forge_tenants_and_forge_rag_manage_keys_and_documents(
    platform: Platform, tmp_path: Path
) -> None:
    base_url, _ = await platform()
    url = base_url.removesuffix("/v1")
    runner = CliRunner()

    async def forge(app: typer.Typer, *args: str, key: str = "") -> Result:
        env = {
            "FORGE_CLI_GATEWAY_URL": url,
            "FORGE_CLI_INFERENCE_GATEWAY_TOKEN": ADMIN_TOKEN,
            "FORGE_CLI_RAG_API_KEY": key,
        }
        return await asyncio.to_thread(runner.invoke, app, list(args), env=env)

    made = await forge(
        tenants_app, "create-key", "acme", "--name", "loader", "--scope", "rag:read", "--scope", "rag:write"
    )
    assert made.exit_code == 0, made.output
    loader = made.output.strip()
    reader = (
        await forge(tenants_app, "create-key", "acme", "--name", "reader", "--scope", "rag:read")
    ).output.strip()

    store = await forge(rag_app, "create-store", "kb", key=loader)
    assert store.exit_code == 0, store.output
    store_id = store.output.strip()
    doc = tmp_path / "zebras.md"
    doc.write_text(FILES["zebras.md"])
    uploaded = await forge(rag_app, "upload", store_id, str(doc), "--json", key=loader)
    assert uploaded.exit_code == 0 and '"completed"' in uploaded.output, uploaded.output
    found = await forge(rag_app, "search", store_id, "zebra stripes", "--json", key=reader)
    assert found.exit_code == 0 and "zebras.md" in found.output, found.output

    # A key without rag:write cannot upload, through the SDK as through the CLI.
    async with sdk(base_url, reader) as read_only:
        with pytest.raises(openai.PermissionDeniedError):
            await read_only.files.create(file=("x.txt", b"text"), purpose="assistants")
    refused = await forge(rag_app, "create-store", "other", key=reader)
    assert refused.exit_code == 1 and "403" in refused.output

    keys = await forge(tenants_app, "keys", "acme", "--json")
    listed = {k["name"]: k for k in json.loads(keys.output)}
    assert listed["loader"]["usage"]["documents"] == 1 and listed["loader"]["scopes"] == [
        "rag:read",
        "rag:write",
    ]
    assert loader not in keys.output and reader not in keys.output

    rotated = await forge(tenants_app, "rotate-key", "acme", "loader", "--overlap", "0")
    assert rotated.exit_code == 0
    assert (await forge(rag_app, "stores", key=loader)).exit_code == 1  # the old secret stopped at once
    assert (await forge(rag_app, "stores", key=rotated.output.strip())).exit_code == 0
    assert (await forge(tenants_app, "revoke-key", "acme", "reader")).exit_code == 0
    assert (await forge(rag_app, "stores", key=reader)).exit_code == 1
    audit = json.loads((await forge(tenants_app, "audit", "acme", "--json")).output)
    assert [e["action"] for e in audit] == ["adopted", "created", "created", "rotated", "created", "revoked"]
