"""The rater web UI over HTTP (in-process ASGI): login, CSRF, rating, double submits, admin pages."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import pytest
import sqlalchemy as sa
from argon2 import PasswordHasher

from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_kit.http import make_app
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry
from forge_preference_feedback.seeds import PreferencePair
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import PreferenceRow
from forge_preference_feedback.web import SESSION_COOKIE, rater_api, rater_ui

if TYPE_CHECKING:
    from conftest import Clock

pytestmark = pytest.mark.asyncio
PASSWORD = "correct horse battery"
# Argon2id with minimal cost: the same code path as production, in microseconds.
FAST_HASHER = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


def pairs(n: int) -> list[PreferencePair]:
    return [
        PreferencePair(
            "test", f"test/k:{i}", f"Human: question {i} <script>x()</script>", f"good {i}", f"bad {i}"
        )
        for i in range(n)
    ]


@pytest.fixture
async def web_service(db: Database, clock: Clock) -> FeedbackService:
    service = FeedbackService(db, lease=dt.timedelta(seconds=60), hasher=FAST_HASHER, clock=clock, overlap=2)
    await service.seed_comparisons(pairs(3), limit=3, rng_seed=0)
    await service.create_rater("alice", PASSWORD)
    await service.create_rater("boss", PASSWORD, is_admin=True)
    return service


@pytest.fixture
async def client(
    web_service: FeedbackService, registry: RewardModelRegistry
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app("preference_feedback")
    app.include_router(rater_ui(web_service, registry, secure_cookies=False, session_max_age_s=3600))
    app.include_router(rater_api(web_service, registry))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def hidden(html: str, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found, f"no hidden field {name}"
    return found.group(1)


async def login(client: httpx.AsyncClient, rater: str = "alice", password: str = PASSWORD) -> httpx.Response:
    page = await client.get("/ui/login")
    return await client.post(
        "/ui/login", data={"rater_id": rater, "password": password, "csrf": hidden(page.text, "csrf")}
    )


async def preferences(db: Database) -> list[PreferenceRow]:
    async with db.session() as session:
        return list((await session.scalars(sa.select(PreferenceRow))).all())


async def events(db: Database) -> int:
    async with db.session() as session:
        return int(await session.scalar(sa.select(sa.func.count()).select_from(OutboxEvent)) or 0)


async def test_pages_need_a_login(client: httpx.AsyncClient, db: Database) -> None:
    page = await client.get("/ui/rate")
    assert (page.status_code, page.headers["location"]) == (303, "/ui/login")
    posted = await client.post("/ui/rate", data={"comparison_id": "x", "choice": "A", "csrf": "x"})
    assert posted.status_code == 401 and await preferences(db) == []


async def test_login_refuses_wrong_password_and_missing_csrf(client: httpx.AsyncClient) -> None:
    wrong = await login(client, password="not the password")
    assert wrong.status_code == 401 and "wrong password" in wrong.text
    assert SESSION_COOKIE not in client.cookies
    unknown = await login(client, rater="mallory")
    assert unknown.status_code == 401 and unknown.text.count("wrong password") == 1
    forged = await client.post("/ui/login", data={"rater_id": "alice", "password": PASSWORD, "csrf": "guess"})
    assert forged.status_code == 403 and SESSION_COOKIE not in client.cookies


async def test_rate_records_once_and_shows_the_next_item(client: httpx.AsyncClient, db: Database) -> None:
    assert (await login(client)).headers["location"] == "/ui/rate"
    page = await client.get("/ui/rate")
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    # Text from the data is escaped, never markup.
    assert "&lt;script&gt;x()&lt;/script&gt;" in page.text and "<script>x()" not in page.text
    first = hidden(page.text, "comparison_id")
    assert '<span id="answered">0</span>' in page.text and '<span id="remaining">3</span>' in page.text
    form = {
        "comparison_id": first,
        "choice": "B",
        "reason": "more helpful",
        "csrf": hidden(page.text, "csrf"),
    }
    once, twice = await client.post("/ui/rate", data=form), await client.post("/ui/rate", data=form)
    assert once.status_code == twice.status_code == 303
    assert once.headers["location"] == twice.headers["location"]  # the double submit is the same record
    rows = await preferences(db)
    assert len(rows) == 1 and await events(db) == 1
    assert (rows[0].rater_id, rows[0].choice, rows[0].rationale, rows[0].ui_version) == (
        "alice",
        2,
        "more helpful",
        "web-1",
    )
    following = await client.get(once.headers["location"])
    assert f"recorded {rows[0].id}" in following.text
    assert hidden(following.text, "comparison_id") != first
    assert (
        '<span id="answered">1</span>' in following.text and '<span id="remaining">2</span>' in following.text
    )
    changed = await client.post("/ui/rate", data={**form, "choice": "A"})
    assert changed.status_code == 409 and len(await preferences(db)) == 1


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"csrf": "forged"}, 403, "CSRF"),
        ({"csrf": ""}, 403, "CSRF"),
        ({"choice": "C"}, 400, "choice: must be A, B, TIE or BOTH_BAD"),
        ({"comparison_id": "cmp-nope"}, 400, "comparison_id: no comparison"),
    ],
)
async def test_bad_posts_are_refused_with_the_reason(
    client: httpx.AsyncClient, db: Database, change: dict[str, str], status: int, message: str
) -> None:
    await login(client)
    page = await client.get("/ui/rate")
    form = {
        "comparison_id": hidden(page.text, "comparison_id"),
        "choice": "A",
        "csrf": hidden(page.text, "csrf"),
    }
    refused = await client.post("/ui/rate", data={**form, **change})
    assert refused.status_code == status and message in refused.text
    assert await preferences(db) == [] and await events(db) == 0


async def test_an_item_not_assigned_to_the_rater_is_refused(
    client: httpx.AsyncClient, web_service: FeedbackService, db: Database
) -> None:
    other = await web_service.next_comparison("bob")
    assert other is not None
    await login(client)
    page = await client.get("/ui/rate")
    mine = hidden(page.text, "comparison_id")
    assert mine != other.id  # bob's live lease steers alice to another item
    refused = await client.post(
        "/ui/rate", data={"comparison_id": other.id, "choice": "A", "csrf": hidden(page.text, "csrf")}
    )
    assert refused.status_code == 400 and "was not assigned to rater &#39;alice&#39;" in refused.text


async def test_overlap_stops_handing_out_an_item_after_k_raters(web_service: FeedbackService) -> None:
    seen: dict[str, int] = {}
    for rater in ["r1", "r2", "r3", "r4"]:
        while (item := await web_service.next_comparison(rater)) is not None:
            await web_service.submit_preference(item.id, rater, 1, 1.0, "")
            seen[item.id] = seen.get(item.id, 0) + 1
    assert sorted(seen.values()) == [2, 2, 2]  # 3 items × k=2, never a third rater


HELDOUT = HeldoutAccuracy(accuracy=0.6, ci95_low=0.56, ci95_high=0.64, n=600, interval="wilson")


async def test_admin_pages_are_for_admins(client: httpx.AsyncClient, registry: RewardModelRegistry) -> None:
    await login(client)
    assert (await client.get("/ui/admin")).status_code == 403
    await registry.register(
        "rm",
        "",
        uri="file:///rm/1",
        snapshot_id="snap-1",
        backbone="tiny",
        heldout=HELDOUT,
        registered_by="ops",
    )
    page = await client.get("/ui/rate")
    denied = await client.post(
        "/ui/admin/reward-models",
        data={"name": "rm", "version": "1", "status": "active", "csrf": hidden(page.text, "csrf")},
    )
    assert denied.status_code == 403
    assert (await registry.get("rm", "1")).status == "candidate"

    client.cookies.clear()
    await login(client, "boss")
    admin = await client.get("/ui/admin")
    assert admin.status_code == 200 and 'data-model="rm:1" data-status="candidate"' in admin.text
    assert "60.0% [56.0%, 64.0%], n=600 (wilson)" in admin.text and "snap-1" in admin.text
    set_active = await client.post(
        "/ui/admin/reward-models",
        data={"name": "rm", "version": "1", "status": "active", "csrf": hidden(admin.text, "csrf")},
    )
    assert set_active.status_code == 303
    changed = await registry.get("rm", "1")
    assert (changed.status, changed.status_changed_by) == ("active", "boss")
    bad = await client.post(
        "/ui/admin/reward-models",
        data={"name": "rm", "version": "1", "status": "deleted", "csrf": hidden(admin.text, "csrf")},
    )
    assert bad.status_code == 400 and "status" in bad.text


async def test_admin_registers_a_version_from_the_page(
    client: httpx.AsyncClient, registry: RewardModelRegistry
) -> None:
    form = {
        "name": "rm-web",
        "uri": "file:///rm/web",
        "snapshot_id": "snap-9",
        "backbone": "forge-policy-tiny:3",
        "accuracy": "0.58",
        "ci95_low": "0.52",
        "ci95_high": "0.64",
        "n": "250",
        "interval": "wilson",
    }
    await login(client)
    page = await client.get("/ui/rate")
    assert (
        await client.post("/ui/admin/reward-models/new", data={**form, "csrf": hidden(page.text, "csrf")})
    ).status_code == 403
    client.cookies.clear()
    await login(client, "boss")
    csrf = hidden((await client.get("/ui/admin")).text, "csrf")
    assert (await client.post("/ui/admin/reward-models/new", data=form)).status_code == 403  # no CSRF token
    bad = await client.post("/ui/admin/reward-models/new", data={**form, "n": "many", "csrf": csrf})
    assert bad.status_code == 400 and "heldout.n" in bad.text
    made = await client.post("/ui/admin/reward-models/new", data={**form, "csrf": csrf})
    assert made.status_code == 303
    row = await registry.get("rm-web", "latest")
    assert (row.version, row.snapshot_id, row.heldout_n, row.registered_by) == ("1", "snap-9", 250, "boss")
    again = await client.post("/ui/admin/reward-models/new", data={**form, "version": "1", "csrf": csrf})
    assert again.status_code == 409


async def test_json_registry_is_for_admins(client: httpx.AsyncClient, registry: RewardModelRegistry) -> None:
    body = {
        "name": "rm",
        "uri": "file:///rm/1",
        "snapshot_id": "snap-1",
        "backbone": "tiny",
        "heldout": {"accuracy": 0.6, "ci95_low": 0.56, "ci95_high": 0.64, "n": 600},
    }
    assert (await client.post("/api/v1/reward-models", json=body)).status_code == 401
    rater = await client.post("/api/v1/sessions", json={"rater_id": "alice", "password": PASSWORD})
    as_rater = {"Authorization": f"Bearer {rater.json()['token']}"}
    for method, path, payload in [
        ("POST", "/api/v1/reward-models", body),
        ("GET", "/api/v1/reward-models", None),
        ("POST", "/api/v1/reward-models/rm/1/status", {"status": "active"}),
    ]:
        refused = await client.request(method, path, json=payload, headers=as_rater)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    boss = await client.post("/api/v1/sessions", json={"rater_id": "boss", "password": PASSWORD})
    as_admin = {"Authorization": f"Bearer {boss.json()['token']}"}
    made = await client.post("/api/v1/reward-models", json=body, headers=as_admin)
    assert made.status_code == 201, made.text
    assert made.json()["version"] == "1" and made.json()["status"] == "candidate"
    assert made.json()["heldout"] == {
        "accuracy": 0.6,
        "ci95_low": 0.56,
        "ci95_high": 0.64,
        "n": 600,
        "interval": "wilson",
    }
    status = await client.post(
        "/api/v1/reward-models/rm/1/status", json={"status": "active"}, headers=as_admin
    )
    assert status.json()["status"] == "active" and status.json()["status_changed_by"] == "boss"
    active = await client.get("/api/v1/reward-models/rm/active", headers=as_admin)
    assert active.json()["snapshot_id"] == "snap-1"
    listed = await client.get("/api/v1/reward-models", headers=as_admin)
    assert listed.json()["total"] == 1
    for bad, field in [
        ({**body, "snapshot_id": ""}, "snapshot_id"),
        ({**body, "heldout": {**body["heldout"], "ci95_high": 0.5}}, "heldout.ci95_low"),
        ({**body, "heldout": {**body["heldout"], "interval": "normal"}}, "heldout.interval"),
    ]:
        refused = await client.post("/api/v1/reward-models", json=bad, headers=as_admin)
        assert refused.status_code == 400 and refused.json()["error"]["field"] == field, refused.text
    missing = await client.get("/api/v1/reward-models/rm/7", headers=as_admin)
    assert missing.status_code == 404
    # An offset past what a database OFFSET holds is refused by name (fuzzing found a 500 there).
    for offset in ("-1", str(2**63)):
        far = await client.get(f"/api/v1/reward-models?offset={offset}", headers=as_admin)
        assert far.status_code == 400 and far.json()["error"]["field"] == "offset", far.text
    assert (await registry.list("", 10, 0))[1] == 1


async def test_admin_page_shows_flagged_raters_with_reasons(
    client: httpx.AsyncClient, web_service: FeedbackService, clock: Clock
) -> None:
    await web_service.seed_comparisons(
        [PreferencePair("t2", f"t2/k:{i}", f"p{i}", "g", "b") for i in range(12)], limit=12, rng_seed=0
    )
    # Two raters answer every item; "quick" in 1 s each, "slow" in 20 s.
    for rater, seconds in [("slow", 20.0), ("quick", 1.0)]:
        service = FeedbackService(web_service._db, clock=clock, overlap=5, hasher=FAST_HASHER)
        while (item := await service.next_comparison(rater)) is not None:
            clock.advance(seconds)
            choice = 1 if item.gold_choice == "A" else 2
            await service.submit_preference(item.id, rater, choice, 1.0, "")
    await login(client, "boss")
    page = await client.get("/ui/admin")
    assert re.search(r'data-rater="quick">.*?too fast \(median 1\.0s per item\)', page.text, re.S)
    assert re.search(r'data-rater="slow">.*?<td>ok</td>', page.text, re.S)
    assert "<strong>quick</strong>: too fast" in page.text


async def test_logout_ends_the_session(client: httpx.AsyncClient) -> None:
    await login(client)
    page = await client.get("/ui/rate")
    out = await client.post("/ui/logout", data={"csrf": hidden(page.text, "csrf")})
    assert out.status_code == 303
    client.cookies.set(SESSION_COOKIE, "stale")
    assert (await client.get("/ui/rate")).headers["location"] == "/ui/login"


async def test_json_api_rates_once_per_answer_and_names_bad_fields(
    client: httpx.AsyncClient, db: Database
) -> None:
    assert (await client.get("/api/v1/comparisons/next")).status_code == 401
    wrong = await client.post("/api/v1/sessions", json={"rater_id": "alice", "password": "nope nope"})
    assert wrong.status_code == 401
    opened = await client.post("/api/v1/sessions", json={"rater_id": "alice", "password": PASSWORD})
    auth = {"Authorization": f"Bearer {opened.json()['token']}"}
    item = (await client.get("/api/v1/comparisons/next", headers=auth)).json()["comparison"]
    assert item["prompt"].startswith("Human:") and item["response_a"] and item["response_b"]
    body = {"comparison_id": item["id"], "choice": "TIE"}
    first = await client.post("/api/v1/preferences", json=body, headers=auth)
    retry = await client.post("/api/v1/preferences", json=body, headers=auth)
    assert first.status_code == retry.status_code == 200 and first.json() == retry.json()
    rows = await preferences(db)
    assert [(r.choice, r.ui_version) for r in rows] == [(3, "api-1")] and await events(db) == 1
    for bad, field in [
        ({**body, "choice": "a"}, "choice"),
        ({**body, "comparison_id": "cmp-none"}, "comparison_id"),
        ({**body, "confidence": 3}, "confidence"),
        ({"choice": "A"}, "comparison_id"),
    ]:
        refused = await client.post("/api/v1/preferences", json=bad, headers=auth)
        assert refused.status_code in (400, 422) and refused.json()["error"]["field"] == field, refused.text
    assert len(await preferences(db)) == 1


async def test_json_api_answers_and_hands_out_the_next_item_in_one_round_trip(
    client: httpx.AsyncClient, db: Database
) -> None:
    """``"next": true`` records the answer, then leases the rater's next item into the reply: the
    three seeded items come one after the other, a retry of a post records nothing twice and
    gets the same next item, and after the last one the reply says nothing is left."""
    opened = await client.post("/api/v1/sessions", json={"rater_id": "alice", "password": PASSWORD})
    auth = {"Authorization": f"Bearer {opened.json()['token']}"}
    item = (await client.get("/api/v1/comparisons/next", headers=auth)).json()["comparison"]
    seen = [item["id"]]
    for turn in range(3):
        body = {"comparison_id": item["id"], "choice": "A", "next": True}
        reply = await client.post("/api/v1/preferences", json=body, headers=auth)
        retry = await client.post("/api/v1/preferences", json=body, headers=auth)
        assert reply.status_code == retry.status_code == 200 and reply.json() == retry.json(), reply.text
        item = reply.json()["next"]["comparison"]
        if turn < 2:
            assert item["id"] not in seen and item["response_a"] and item["response_b"]
            seen.append(item["id"])
    assert item is None
    rows = await preferences(db)
    assert sorted(r.comparison_id for r in rows) == sorted(seen) and await events(db) == 3
    # Without "next" the reply is the preference alone, as before.
    [first] = [r.id for r in rows if r.comparison_id == seen[0]]
    plain = await client.post(
        "/api/v1/preferences", json={"comparison_id": seen[0], "choice": "A"}, headers=auth
    )
    assert plain.json() == {"preference_id": first}
