"""The tenant opt-in to training on its prompts: off by default; the gateway records prompts only
for tenants that opted in (with size limits), and the RLHF prompt pool lists only theirs.

Requests go through the official ``openai`` SDK to the gateway in process, in front of a real HTTP
server replaying recorded model-server answers (``conftest.RecordedUpstream``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.tenants.training_prompts import TrainingPrompts, prompt_text
from forge_kit.http import make_app

from .conftest import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def upstream_url(recorded: Any) -> str:
    return str(recorded.url)


@pytest.fixture
def transport(gateway: InferenceGateway) -> httpx.ASGITransport:
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN)
    return httpx.ASGITransport(app=app, raise_app_exceptions=False)


@pytest.fixture
async def admin(transport: httpx.ASGITransport) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=ADMIN) as client:
        yield client


def sdk(transport: httpx.ASGITransport, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key=key,
        base_url="http://gateway/v1",
        http_client=httpx.AsyncClient(transport=transport, base_url="http://gateway"),
        max_retries=0,
    )


async def chat(client: openai.AsyncOpenAI, text: str) -> None:
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], stream=True
    )
    async for _ in stream:
        pass


async def pool(admin: httpx.AsyncClient, **params: int) -> list[dict[str, object]]:
    reply = await admin.get("/admin/v1/training-prompts", params=params)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["prompts"])


async def test_only_opted_in_tenants_prompts_reach_the_pool(
    admin: httpx.AsyncClient, transport: httpx.ASGITransport, gateway: InferenceGateway
) -> None:
    made = await admin.post("/admin/v1/tenants", json={"name": "shop"})
    assert made.status_code == 201 and made.json()["tenant"]["allow_training"] is False  # off by default
    shop = made.json()["api_key"]
    lab = (await admin.post("/admin/v1/tenants", json={"name": "lab", "allow_training": True})).json()
    assert lab["tenant"]["allow_training"] is True
    shop_client, lab_client = sdk(transport, shop), sdk(transport, lab["api_key"])
    await chat(shop_client, "private question of the shop")
    await shop_client.completions.create(model="tiny", prompt="shop completion prompt", stream=True)
    await chat(lab_client, "how do tides work?")
    await chat(lab_client, "how do tides work?")  # the same prompt is kept once
    await lab_client.completions.create(model="tiny", prompt="Write a haiku about rain.", stream=True)
    await chat(lab_client, "x" * 4001)  # over the size limit: not recorded
    prompts = await pool(admin)
    assert [(p["tenant"], p["prompt"]) for p in prompts] == [
        ("lab", "how do tides work?"),
        ("lab", "Write a haiku about rain."),
    ]
    # The shop opts in: from then on its prompts are recorded, never the earlier ones.
    opted = await admin.put("/admin/v1/tenants/shop/training", json={"allow_training": True})
    assert opted.status_code == 200 and opted.json()["tenant"]["allow_training"] is True
    gateway.tenants._cached.clear()  # the key lookup is cached for a few seconds in each replica
    await chat(shop_client, "a question the shop allows")
    assert [p["prompt"] for p in await pool(admin)][-1] == "a question the shop allows"
    assert "private question of the shop" not in {p["prompt"] for p in await pool(admin)}
    # The lab opts out: what it sent before leaves the pool too.
    await admin.put("/admin/v1/tenants/lab/training", json={"allow_training": False})
    assert {p["tenant"] for p in await pool(admin)} == {"shop"}
    # Paging by seq.
    first = await pool(admin, limit=1)
    assert await pool(admin, after=int(first[0]["seq"])) == []  # type: ignore[arg-type]


async def test_the_opt_in_api_refuses_bad_input(
    admin: httpx.AsyncClient, transport: httpx.ASGITransport
) -> None:
    assert (
        await admin.put("/admin/v1/tenants/nobody/training", json={"allow_training": True})
    ).status_code == 404
    for body in ({"allow_training": "yes"}, {}, {"allow_training": 1}):
        reply = await admin.put("/admin/v1/tenants/default/training", json=body)
        assert reply.status_code == 400, body
    assert (
        await admin.post("/admin/v1/tenants", json={"name": "t2", "allow_training": "true"})
    ).status_code == 400
    for params in ({"limit": 0}, {"limit": 5000}, {"after": -1}):
        assert (await admin.get("/admin/v1/training-prompts", params=params)).status_code == 400, params
    # A parameter the route does not declare (a misspelt limit) is refused, naming it, on every
    # admin route: not ignored.
    for path, params in (
        ("/admin/v1/training-prompts", {"limt": "5"}),
        ("/admin/v1/shadow/pairs", {"alias": "forge-chat", "after": "3"}),
        ("/admin/v1/tenants", {"x": "1"}),
    ):
        reply = await admin.get(path, params=params)
        assert reply.status_code == 400 and "unknown parameter" in reply.text, (path, reply.text)
    assert (await admin.get("/admin/v1/training-prompts", params={"limit": "5"})).status_code == 200
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as anonymous:
        assert (await anonymous.get("/admin/v1/training-prompts")).status_code == 401
        tenant_key = {"Authorization": "Bearer tenant-key"}
        assert (await anonymous.get("/admin/v1/training-prompts", headers=tenant_key)).status_code in (
            401,
            403,
        )


async def test_per_tenant_cap_and_prompt_forms(gateway: InferenceGateway, db: Any) -> None:
    recorder = TrainingPrompts(db, max_chars=10, max_per_tenant=2)
    tenant, _ = await gateway.tenants.create_tenant("capped", allow_training=True)
    assert await recorder.record(tenant, {"prompt": "one"})
    assert await recorder.record(tenant, {"messages": [{"role": "user", "content": "two"}]})
    assert not await recorder.record(tenant, {"prompt": "three"})  # the tenant is full
    assert [p.prompt for p in await recorder.pool()] == ["one", "two"]
    assert prompt_text({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) is None
    assert prompt_text({"prompt": ["a", "b"]}) is None
    other, _ = await gateway.tenants.create_tenant("closed")
    assert not await recorder.record(other, {"prompt": "never"})
