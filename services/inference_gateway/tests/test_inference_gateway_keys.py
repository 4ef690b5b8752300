"""The key lifecycle through the gateway's HTTP API: several keys per tenant, scopes, rotation with
an overlap window, revocation, expiry, usage per key, the audit log; the wall clock is the test's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import REGISTRY

from forge_inference_gateway.keys.service import ApiKeys
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.vector_stores.index import GrpcDocumentIndex
from forge_inference_gateway.vector_stores.service import VectorStores
from forge_kit.db import Database
from forge_kit.http import make_app

from .conftest import ADMIN_TOKEN


class WallClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall() -> WallClock:
    return WallClock()


@pytest.fixture
async def app_client(
    gateway: InferenceGateway, db: Database, wall: WallClock
) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's HTTP API in process with keys on the test's wall clock; no credentials set."""
    gateway.keys = ApiKeys(db, gateway.tenants, now=wall)
    # The document routes are installed to check their scopes; the retriever is never reached.
    index = GrpcDocumentIndex("127.0.0.1:1", "token")
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN, stores=VectorStores(db, index))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=15) as client:
        yield client
    await index.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN = bearer(ADMIN_TOKEN)


async def new_tenant(client: httpx.AsyncClient, name: str) -> str:
    reply = await client.post("/admin/v1/tenants", json={"name": name, "rpm_limit": 1000}, headers=ADMIN)
    assert reply.status_code == 201, reply.text
    return str(reply.json()["api_key"])


async def test_keys_are_listed_without_secrets_and_scopes_are_enforced(app_client: httpx.AsyncClient) -> None:
    first = await new_tenant(app_client, "acme")
    reader = await app_client.post(
        "/admin/v1/tenants/acme/keys", json={"name": "reader", "scopes": ["rag:read"]}, headers=ADMIN
    )
    assert reader.status_code == 201, reader.text
    secret = reader.json()["api_key"]
    assert secret.startswith("fk-") and reader.json()["key"]["prefix"] == secret[:10]

    listed = await app_client.get("/admin/v1/tenants/acme/keys", headers=ADMIN)
    assert listed.status_code == 200
    keys = {k["name"]: k for k in listed.json()["data"]}
    # The tenant's first key is listed (adopted as "primary"), with every scope; no secret anywhere.
    assert set(keys) == {"primary", "reader"}
    assert keys["primary"]["scopes"] == ["inference", "rag:read", "rag:write", "embeddings"]
    assert keys["reader"]["scopes"] == ["rag:read"] and keys["reader"]["state"] == "active"
    assert secret not in listed.text and first not in listed.text and "hash" not in listed.text

    # Both keys work; the reader may read documents but not write them, nor generate, nor embed.
    assert (await app_client.get("/v1/vector_stores", headers=bearer(first))).status_code == 200
    assert (await app_client.get("/v1/vector_stores", headers=bearer(secret))).status_code == 200
    for method, path in (
        ("POST", "/v1/vector_stores"),
        ("POST", "/v1/files"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
    ):
        denied = await app_client.request(method, path, json={}, headers=bearer(secret))
        assert denied.status_code == 403, (path, denied.text)
        assert denied.json()["error"]["type"] == "permission_error"
    unknown = await app_client.post(
        "/admin/v1/tenants/acme/keys", json={"name": "x", "scopes": ["admin"]}, headers=ADMIN
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "scopes"
    # Key management is the admin's: a tenant key is refused there.
    assert (await app_client.get("/admin/v1/tenants/acme/keys", headers=bearer(first))).status_code == 401


async def test_a_rotated_key_works_during_the_overlap_and_fails_after(
    app_client: httpx.AsyncClient, wall: WallClock
) -> None:
    old = await new_tenant(app_client, "acme")
    rotated = await app_client.post(
        "/admin/v1/tenants/acme/keys/primary/rotate", json={"overlap_s": 60}, headers=ADMIN
    )
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()["api_key"]
    assert rotated.json()["key"]["rotated_from"]
    wall.now += 59
    assert (await app_client.get("/v1/keys", headers=bearer(old))).status_code == 200
    assert (await app_client.get("/v1/keys", headers=bearer(new))).status_code == 200
    wall.now += 2
    expired = await app_client.get("/v1/keys", headers=bearer(old))
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
    assert (await app_client.get("/v1/keys", headers=bearer(new))).status_code == 200
    states = {
        k["id"]: k["state"]
        for k in (await app_client.get("/admin/v1/tenants/acme/keys", headers=ADMIN)).json()["data"]
    }
    assert sorted(states.values()) == ["active", "expired"]


async def test_revoked_and_expired_keys_fail_and_every_change_is_audited(
    app_client: httpx.AsyncClient, wall: WallClock
) -> None:
    await new_tenant(app_client, "acme")
    short = await app_client.post(
        "/admin/v1/tenants/acme/keys", json={"name": "ci", "expires_in_s": 10}, headers=ADMIN
    )
    ci_key, ci_id = short.json()["api_key"], short.json()["key"]["id"]
    spare = await app_client.post("/admin/v1/tenants/acme/keys", json={"name": "spare"}, headers=ADMIN)
    spare_key, spare_id = spare.json()["api_key"], spare.json()["key"]["id"]
    assert (await app_client.get("/v1/keys", headers=bearer(spare_key))).status_code == 200
    revoked = await app_client.delete(f"/admin/v1/tenants/acme/keys/{spare_id}", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    gone = await app_client.get("/v1/keys", headers=bearer(spare_key))
    assert gone.status_code == 401 and "revoked" in gone.json()["error"]["message"]
    assert (await app_client.get("/v1/keys", headers=bearer(ci_key))).status_code == 200
    wall.now += 11
    assert (await app_client.get("/v1/keys", headers=bearer(ci_key))).status_code == 401
    missing = await app_client.delete("/admin/v1/tenants/acme/keys/key_nope", headers=ADMIN)
    assert missing.status_code == 404

    audit = (await app_client.get("/admin/v1/tenants/acme/audit", headers=ADMIN)).json()["events"]
    assert [(e["action"], e["key_id"]) for e in audit][2:] == [
        ("created", ci_id),
        ("created", spare_id),
        ("revoked", spare_id),
    ]
    assert [e["action"] for e in audit[:2]] == ["tenant.created", "adopted"]
    assert all(e["actor"] == "admin" for e in audit) and audit[0]["detail"]["rpm_limit"] == 1000
    assert audit[2]["detail"]["expires_in_s"] == 10


async def test_usage_is_counted_per_key_in_the_api_and_the_metrics(app_client: httpx.AsyncClient) -> None:
    await new_tenant(app_client, "acme")
    made = await app_client.post("/admin/v1/tenants/acme/keys", json={"name": "app"}, headers=ADMIN)
    key, key_id = made.json()["api_key"], made.json()["key"]["id"]

    def counted() -> float:
        labels = {"tenant": "acme", "key": key_id, "kind": "requests"}
        return REGISTRY.get_sample_value("forge_gateway_key_usage_total", labels) or 0.0

    before = counted()
    for _ in range(3):
        assert (await app_client.get("/v1/vector_stores", headers=bearer(key))).status_code == 200
    own = (await app_client.get("/v1/keys", headers=bearer(key))).json()["data"]
    mine = next(k for k in own if k["id"] == key_id)
    assert mine["usage"]["requests"] == 4  # three lists and this read itself
    assert mine["last_used_at"] is not None
    assert counted() - before == 4


async def test_the_openapi_document_has_the_schemas_of_documents_and_keys(
    app_client: httpx.AsyncClient,
) -> None:
    doc = (await app_client.get("/openapi.json")).json()

    def ref(schema: dict[str, object]) -> str:
        return str(schema.get("$ref", "")).rsplit("/", 1)[-1]

    create = doc["paths"]["/v1/vector_stores"]["post"]
    assert ref(create["requestBody"]["content"]["application/json"]["schema"]) == "VectorStoreCreate"
    assert ref(create["responses"]["200"]["content"]["application/json"]["schema"]) == "VectorStoreOut"
    assert {"400", "401", "403", "404", "413"} <= set(create["responses"])
    upload = doc["paths"]["/v1/files"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"]
    status = doc["components"]["schemas"]["VectorStoreFileOut"]["properties"]["status"]
    assert status["enum"] == ["in_progress", "completed", "failed"]
    search = doc["paths"]["/v1/vector_stores/{store_id}/search"]["post"]
    assert ref(search["responses"]["200"]["content"]["application/json"]["schema"]) == "SearchPage"
    rag = doc["components"]["schemas"]["RagQueryBody"]
    assert "model" in rag["required"] and "vector_store_id" in rag["properties"]
    issued = doc["paths"]["/admin/v1/tenants/{name}/keys"]["post"]["responses"]["201"]
    assert ref(issued["content"]["application/json"]["schema"]) == "KeyIssued"
