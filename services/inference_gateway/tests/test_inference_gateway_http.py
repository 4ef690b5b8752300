"""The public and admin HTTP API in process: auth, rate limits, error mapping, stream relay."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from forge_kit.modelref import ModelRef
from forge_kit.testing import free_port

CHAT = "/v1/chat/completions"
HI = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def upstream_url(recorded: Any) -> str:
    return str(recorded.url)


async def test_missing_or_wrong_key_is_401_openai_error(http: httpx.AsyncClient) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer nope"}):
        reply = await http.post(CHAT, json=HI, headers=headers)
        assert reply.status_code == 401
        assert reply.json()["error"]["type"] == "authentication_error"
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


async def test_over_the_rate_limit_is_429_with_retry_after(http: httpx.AsyncClient) -> None:
    statuses = [(await http.post(CHAT, json={**HI, "model": "other"})).status_code for _ in range(6)]
    assert statuses == [404] * 5 + [429]
    reply = await http.post(CHAT, json=HI)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "12"
    assert reply.json()["error"]["code"] == "rate_limit_exceeded"


async def test_bad_body_is_400_naming_the_field(http: httpx.AsyncClient) -> None:
    reply = await http.post(CHAT, content=b"{oops", headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body"
    reply = await http.post(CHAT, json={"messages": []})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


async def test_upstream_404_body_passes_through(http: httpx.AsyncClient) -> None:
    reply = await http.post(CHAT, json={**HI, "model": "huge"})
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": "The model `huge` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


async def test_upstream_500_becomes_502_without_its_trace(http: httpx.AsyncClient) -> None:
    reply = await http.post(CHAT, json=HI)
    assert reply.status_code == 502 and "Traceback" not in reply.text
    assert reply.json()["error"]["code"] == "bad_gateway"


async def test_stream_is_relayed_and_alias_rewritten(
    http: httpx.AsyncClient, recorded: Any, gateway: object, db: object, promoted: object
) -> None:
    async with db.session() as session:  # type: ignore[attr-defined]
        await gateway.aliases.apply_model_promoted(promoted("tiny"), session)  # type: ignore[attr-defined,operator]
    await gateway.pool.refresh()  # type: ignore[attr-defined]  # the control loop's scrape: what it serves
    async with http.stream("POST", CHAT, json={**HI, "model": "forge-chat", "stream": True}) as reply:
        assert reply.status_code == 200
        relayed = b"".join([chunk async for chunk in reply.aiter_raw()])
    assert relayed == recorded.sse
    sent = recorded.requests[-1]
    assert sent.body["model"] == "tiny" and sent.headers["authorization"] == "Bearer upstream-token"
    # The version that answered is the one the replica lists for the name (the alias pinned none).
    assert reply.headers["x-forge-model"] == "tiny:7"


async def test_a_model_that_is_no_model_reference_is_400_naming_model(http: httpx.AsyncClient) -> None:
    for model in ("tiny model", "../etc/passwd", "tiny:", "a" * 300, "tiny\u0000"):
        reply = await http.post(CHAT, json={**HI, "model": model})
        assert reply.status_code == 400, model
        error = reply.json()["error"]
        assert error["param"] == "model" and "invalid model" in error["message"]
        assert "x-forge-model" not in reply.headers


async def test_an_alias_no_replica_serves_is_404_naming_the_alias(
    http: httpx.AsyncClient, gateway: Any, db: Any, promoted: Any
) -> None:
    """The registry promoted a version the replicas do not serve: the caller learns about the name
    they sent, not the registry's identity behind it."""
    async with db.session() as session:
        await gateway.aliases.apply_model_promoted(promoted("run-4f2e", "step-120"), session)
    for body in ({**HI, "model": "forge-chat"}, {**HI, "model": "forge-chat", "stream": True}):
        reply = await http.post(CHAT, json=body)
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "`forge-chat`" in error["message"] and "run-4f2e" not in error["message"]
    models = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["tiny"], "an alias that cannot answer is not listed"


async def test_admin_requires_the_service_token(http: httpx.AsyncClient) -> None:
    assert (await http.get("/admin/v1/aliases")).status_code == 401
    reply = await http.post(
        "/admin/v1/tenants",
        json={"name": "batch-jobs", "priority_class": "batch"},
        headers={"Authorization": "Bearer admin-token"},
    )
    assert reply.status_code == 201
    key = reply.json()["api_key"]
    tenants = (await http.get("/admin/v1/tenants", headers={"Authorization": "Bearer admin-token"})).json()
    assert [t["name"] for t in tenants["tenants"]] == ["batch-jobs", "default"]
    assert "key_hash" not in tenants["tenants"][0] and key not in json.dumps(tenants)
    reply = await http.post(CHAT, json={**HI, "model": "huge"}, headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 404


class TestUpstreamDown:
    @pytest.fixture
    def upstream_url(self) -> str:
        return f"http://127.0.0.1:{free_port()}"  # nothing listens there

    @pytest.mark.integration
    async def test_unreachable_model_server_is_503_with_retry_after(self, http: httpx.AsyncClient) -> None:
        for reply in (
            await http.post(CHAT, json=HI),
            await http.get("/v1/models"),
            await http.post(CHAT, json={**HI, "stream": True}),
        ):
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "unavailable"


class TestNoConfiguredReplica:
    """``MODEL_SERVER_URL`` empty: the pool holds only what the admin API adds (a deployment's
    replicas once they answer)."""

    @pytest.fixture
    def upstream_url(self) -> str:
        return ""

    async def test_an_empty_pool_serves_nothing_clearly_until_a_replica_is_added(
        self, http: httpx.AsyncClient, recorded: Any, clock: Any
    ) -> None:
        admin = {"Authorization": "Bearer admin-token"}

        async def refused_clearly() -> None:
            clock.now += 60  # a fresh minute of the tenant's 5 requests
            assert (await http.get("/v1/models")).json() == {"object": "list", "data": []}
            card = await http.get("/v1/models/tiny")
            assert card.status_code == 404 and card.json()["error"]["code"] == "model_not_found"
            for body in (HI, {**HI, "stream": True}):
                reply = await http.post(CHAT, json=body)
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
                error = reply.json()["error"]
                assert error["code"] == "unavailable", error
                assert "'tiny'" in error["message"] and "replica pool is empty" in error["message"]

        await refused_clearly()
        added = await http.post("/admin/v1/replicas", json={"url": recorded.url}, headers=admin)
        assert added.status_code == 201, added.text
        clock.now += 60
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["tiny"]
        async with http.stream("POST", CHAT, json={**HI, "stream": True}) as reply:
            assert reply.status_code == 200
            assert b"".join([c async for c in reply.aiter_raw()]) == recorded.sse
        removed = await http.delete("/admin/v1/replicas", params={"url": recorded.url}, headers=admin)
        assert removed.status_code == 204
        await refused_clearly()


async def test_admin_bad_input_is_400_naming_the_field(http: httpx.AsyncClient) -> None:
    admin = {"Authorization": "Bearer admin-token"}
    for method, path, kwargs, field in (
        ("POST", "/admin/v1/replicas", {"json": {"url": "http://[::1"}}, "url"),
        ("POST", "/admin/v1/replicas", {"json": {}}, "url"),
        ("DELETE", "/admin/v1/replicas", {"params": {"url": "nope"}}, "url"),
        ("DELETE", "/admin/v1/replicas", {}, "query.url"),
        ("PUT", "/admin/v1/aliases/forge-chat/canary", {"json": {"weight": 5}}, "model"),
        (
            "PUT",
            "/admin/v1/aliases/forge-chat/canary",
            {"json": {"model": {"name": "x"}, "weight": -1}},
            "weight",
        ),
    ):
        reply = await http.request(method, path, headers=admin, **kwargs)
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == field
    reply = await http.delete("/admin/v1/replicas", params={"url": "http://elsewhere:1"}, headers=admin)
    assert reply.status_code == 404
    body = {"model": "tiny", "prompt": "x"}
    for bad, field in (
        ({"priority": "high"}, "priority"),
        ({"priority": True}, "priority"),
        ({"stream": "yes"}, "stream"),
    ):
        reply = await http.post("/v1/completions", json={**body, **bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field


async def test_a_replica_without_tokenize_leaves_the_count_to_the_caller(gateway: Any) -> None:
    """The recorded replica has no ``/tokenize`` (404): no count, so RAG keeps its estimate."""
    await gateway.pool.ensure_known()
    messages = [{"role": "user", "content": "hello"}]
    assert await gateway.count_tokens(ModelRef("tiny"), messages, gateway.deadline()) is None
