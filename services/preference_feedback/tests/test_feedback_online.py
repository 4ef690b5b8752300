"""Comparisons of an online RLHF round: the policy's own samples queued over gRPC (AddComparisons)
next to seed data, answered by raters through the same interface, counted per batch. Which items
are policy samples is visible to admins only: the rater page and the rater API have no such field.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest
from argon2 import PasswordHasher
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit.db import Database
from forge_kit.grpckit import GrpcServer, Principal, make_channel
from forge_kit.http import make_app
from forge_kit.testing.grpcserver import grpc_test_server
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.seeds import PreferencePair
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.web import rater_api, rater_ui

if TYPE_CHECKING:
    from conftest import Clock

pytestmark = pytest.mark.asyncio
TOKEN = "test-token"
VIEWER = "viewer-token"
PASSWORD = "correct horse battery"
FAST_HASHER = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
BATCH = "rlhf-wf/r1"


def seed_pairs(n: int) -> list[PreferencePair]:
    return [
        PreferencePair("hh-rlhf/test", f"seed:{i}", f"Human: q{i}", f"good {i}.", f"bad {i}")
        for i in range(n)
    ]


def policy_samples(n: int) -> list[feedback_pb2.NewComparison]:
    return [
        feedback_pb2.NewComparison(
            key=f"p{i}",
            prompt=f"Human: policy prompt {i}\n\nAssistant:",
            response_1=f"sample at t=0.7 number {i}.",
            model_1="policy:1@0.7",
            response_2=f"sample at t=1.2 number {i}",
            model_2="policy:1@1.2",
        )
        for i in range(n)
    ]


@pytest.fixture
async def online_service(db: Database, clock: Clock) -> FeedbackService:
    service = FeedbackService(db, lease=dt.timedelta(seconds=60), hasher=FAST_HASHER, clock=clock, overlap=2)
    await service.seed_comparisons(seed_pairs(2), limit=2, rng_seed=0)
    await service.create_rater("alice", PASSWORD)
    await service.create_rater("boss", PASSWORD, is_admin=True)
    return service


@pytest.fixture
async def server(online_service: FeedbackService, registry: RewardModelRegistry) -> AsyncIterator[GrpcServer]:
    api = FeedbackApi(online_service, registry, max_page_size=100)
    async with grpc_test_server(
        feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server,
        api,
        "forge.feedback.v1.PreferenceFeedbackService",
        token=TOKEN,
        service="preference_feedback",
        authenticators=[lambda token: Principal("viewer", "team", "research") if token == VIEWER else None],
    ) as started:
        yield started


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[feedback_pb2_grpc.PreferenceFeedbackServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)


@pytest.fixture
async def client(
    online_service: FeedbackService, registry: RewardModelRegistry
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app("preference_feedback")
    app.include_router(rater_ui(online_service, registry, secure_cookies=False, session_max_age_s=3600))
    app.include_router(rater_api(online_service, registry))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as http:
        yield http


async def test_policy_samples_are_queued_once_answered_and_counted_per_batch(
    stub: feedback_pb2_grpc.PreferenceFeedbackServiceStub, clock: Clock
) -> None:
    request = feedback_pb2.AddComparisonsRequest(batch=BATCH, origin="policy", comparisons=policy_samples(3))
    first = await stub.AddComparisons(request)
    again = await stub.AddComparisons(request)  # a retried activity adds nothing
    assert (first.added, first.already_present) == (3, 0)
    assert (again.added, again.already_present) == (0, 3)
    # A rater is handed the policy samples first (the round waits on them), then the seed items,
    # through the same RPC; each sample shows the two responses of the policy in either order.
    seen: list[feedback_pb2.Comparison] = []
    while True:
        reply = await stub.GetNextComparison(feedback_pb2.GetNextComparisonRequest(rater_id="r1"))
        if not reply.HasField("comparison"):
            break
        seen.append(reply.comparison)
        clock.advance(5)
        await stub.SubmitPreference(
            feedback_pb2.SubmitPreferenceRequest(
                comparison_id=reply.comparison.id,
                rater_id="r1",
                choice=common_pb2.PREFERENCE_CHOICE_A,
                confidence=0.9,
            )
        )
    prompts = [c.prompt for c in seen]
    assert prompts[3:] == ["Human: q0", "Human: q1"]
    assert prompts[:3] == [f"Human: policy prompt {i}\n\nAssistant:" for i in range(3)]
    for c in seen[:3]:
        n = c.prompt.split()[3]
        assert {c.response_a.text, c.response_b.text} == {
            f"sample at t=0.7 number {n}.",
            f"sample at t=1.2 number {n}",
        }
    stats = await stub.GetPreferenceStats(feedback_pb2.GetPreferenceStatsRequest(batch=BATCH))
    assert (stats.batch_comparisons, stats.batch_answers, stats.batch_accepted, stats.batch_raters) == (
        3,
        3,
        3,
        1,
    )
    assert stats.accepted_pairs == 5  # the seed answers count in the totals, not in the batch
    other = await stub.GetPreferenceStats(feedback_pb2.GetPreferenceStatsRequest(batch="rlhf-wf/r2"))
    assert (other.batch_comparisons, other.batch_answers) == (0, 0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"batch": ""}, "batch"),
        ({"batch": "../../etc"}, "batch"),
        ({"origin": "seed"}, "origin"),
        ({"key": "a b"}, "comparisons[0].key"),
        ({"response_1": ""}, "comparisons[0].response_1"),
        ({"response_2": "a\x00b"}, "comparisons[0].response_2"),
        ({"prompt": "x" * 20_001}, "comparisons[0].prompt"),
    ],
)
async def test_bad_comparisons_are_refused_with_the_field(
    stub: feedback_pb2_grpc.PreferenceFeedbackServiceStub, change: dict[str, str], field: str
) -> None:
    item = policy_samples(1)[0]
    batch, origin = change.pop("batch", BATCH), change.pop("origin", "policy")
    for name, value in change.items():
        setattr(item, name, value)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.AddComparisons(
            feedback_pb2.AddComparisonsRequest(batch=batch, origin=origin, comparisons=[item])
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (caught.value.details() or "")
    nothing = await stub.GetPreferenceStats(feedback_pb2.GetPreferenceStatsRequest(batch=BATCH))
    assert nothing.batch_comparisons == 0


async def test_only_admins_queue_comparisons(server: GrpcServer) -> None:
    async with make_channel(f"127.0.0.1:{server.port}", token=VIEWER) as channel:
        viewer = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await viewer.AddComparisons(
                feedback_pb2.AddComparisonsRequest(
                    batch=BATCH, origin="policy", comparisons=policy_samples(1)
                )
            )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


def hidden(html: str, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found, f"no hidden field {name}"
    return found.group(1)


async def test_origin_is_shown_to_admins_only(
    online_service: FeedbackService, client: httpx.AsyncClient
) -> None:
    from forge_preference_feedback.service import NewComparison

    await online_service.add_comparisons(
        BATCH,
        "policy",
        [NewComparison("p0", "Human: which?", "one.", "policy:1@0.7", "two", "policy:1@1.2")],
    )
    rater = await client.post("/api/v1/sessions", json={"rater_id": "alice", "password": PASSWORD})
    as_rater = {"Authorization": f"Bearer {rater.json()['token']}"}
    # The rater API hands out seed items and policy samples with the same fields, no origin.
    fields = set()
    for _ in range(3):
        item = (await client.get("/api/v1/comparisons/next", headers=as_rater)).json()["comparison"]
        fields.add(frozenset(item))
        await client.post(
            "/api/v1/preferences", json={"comparison_id": item["id"], "choice": "A"}, headers=as_rater
        )
    assert fields == {frozenset({"id", "prompt", "response_a", "response_b"})}
    listing = await client.get("/api/v1/comparisons", headers=as_rater)
    assert listing.status_code == 403
    # The rater page shows neither origin nor batch nor the models.
    page = await client.get("/ui/login")
    await client.post(
        "/ui/login", data={"rater_id": "alice", "password": PASSWORD, "csrf": hidden(page.text, "csrf")}
    )
    rate = (await client.get("/ui/rate")).text
    for secret in ("policy", BATCH, "seed", "@0.7"):
        assert secret not in rate
    assert (await client.get("/ui/admin")).status_code == 403
    # The admin sees the origin of each item, in the API and on the admin page.
    boss = await client.post("/api/v1/sessions", json={"rater_id": "boss", "password": PASSWORD})
    as_admin = {"Authorization": f"Bearer {boss.json()['token']}"}
    rows = (await client.get("/api/v1/comparisons", headers=as_admin)).json()["comparisons"]
    assert [r["origin"] for r in rows] == ["policy", "seed", "seed"]
    assert rows[0]["batch"] == BATCH and {rows[0]["model_a"], rows[0]["model_b"]} == {
        "policy:1@0.7",
        "policy:1@1.2",
    }
    only = (await client.get("/api/v1/comparisons", params={"origin": "policy"}, headers=as_admin)).json()
    assert [r["id"] for r in only["comparisons"]] == [rows[0]["id"]]
    await client.post("/ui/logout", data={"csrf": hidden(rate, "csrf")})
    page = await client.get("/ui/login")
    await client.post(
        "/ui/login", data={"rater_id": "boss", "password": PASSWORD, "csrf": hidden(page.text, "csrf")}
    )
    admin = (await client.get("/ui/admin")).text
    assert 'id="origins"' in admin and BATCH in admin and "policy" in admin
