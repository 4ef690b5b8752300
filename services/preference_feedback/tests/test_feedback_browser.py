"""The rater UI in a real headless browser: Playwright driving Debian's ``chromium`` against the
real HTTP server. Log in, rate with the mouse and with the keyboard, see the next item and see
the answer recorded (with its outbox event)."""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from argon2 import PasswordHasher

from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_kit.http import HttpServer, make_app
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import PreferenceRow
from forge_preference_feedback.web import rater_ui

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="pip install -e 'services/preference_feedback[browser]'"
)
pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PASSWORD = "correct horse battery"


@pytest.fixture
async def base_url(db: Database, hh_root: Path) -> AsyncIterator[str]:
    service = FeedbackService(
        db, lease=dt.timedelta(seconds=60), hasher=PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
    )
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=4, rng_seed=0)
    await service.create_rater("alice", PASSWORD)
    app = make_app("preference_feedback")
    app.include_router(
        rater_ui(service, RewardModelRegistry(db), secure_cookies=False, session_max_age_s=3600)
    )
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


async def recorded(db: Database) -> list[tuple[str, int, str]]:
    async with db.session() as session:
        rows = (await session.scalars(sa.select(PreferenceRow).order_by(PreferenceRow.created_at))).all()
        return [(r.comparison_id, r.choice, r.rationale) for r in rows]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
async def test_log_in_rate_with_mouse_and_keyboard_and_see_it_recorded(base_url: str, db: Database) -> None:
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = await browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

        await page.goto(f"{base_url}/ui/rate")
        assert page.url.endswith("/ui/login")
        await page.get_by_label("Rater name").fill("alice")
        await page.get_by_label("Password").fill("wrong password!")
        await page.get_by_role("button", name="Log in").click()
        assert "wrong password" in await page.get_by_role("alert").inner_text()
        assert await page.get_by_label("Rater name").input_value() == "alice"  # kept after a failure
        await page.get_by_label("Password").fill(PASSWORD)
        await page.get_by_role("button", name="Log in").click()
        await page.wait_for_url("**/ui/rate")

        # 0. The question and the guidelines are on screen, and the reason box fits its column.
        await playwright_api.expect(
            page.get_by_role("heading", name="Which response is better?")
        ).to_be_visible()
        await playwright_api.expect(page.locator("#guidelines")).to_be_visible()
        assert "helpful" in await page.locator("#guidelines").inner_text()
        for width in (1280, 600):  # two columns, and one on a narrow screen
            await page.set_viewport_size({"width": width, "height": 900})
            box = await page.locator("#reason").bounding_box()
            column = await page.locator("#rate-form").bounding_box()
            assert box is not None and column is not None
            assert column["x"] <= box["x"] and box["x"] + box["width"] <= column["x"] + column["width"], (
                width,
                box,
                column,
            )

        # 1. The mouse: a reason and "B is better"; a double click records once.
        first = await page.locator("#rate-form").get_attribute("data-comparison")
        assert (await page.locator("#prompt").inner_text()).startswith("Human:")
        assert (
            await page.locator("#response-a").inner_text() and await page.locator("#response-b").inner_text()
        )
        await page.get_by_label("Reason (optional)").fill("B answers the question")
        await page.locator("#choose-b").dblclick()
        await page.wait_for_selector("#recorded")
        await page.wait_for_load_state()  # the shortcut script has run
        assert await page.locator("#answered").inner_text() == "1"
        second = await page.locator("#rate-form").get_attribute("data-comparison")
        assert second and second != first
        assert await recorded(db) == [(first, 2, "B answers the question")]

        # 2. The keyboard: "1" chooses A without touching the mouse.
        await page.keyboard.press("1")
        await playwright_api.expect(page.locator("#answered")).to_have_text("2")
        assert [r[:2] for r in await recorded(db)] == [(first, 2), (second, 1)]
        await page.wait_for_load_state()

        # 3. Typing a reason does not trigger shortcuts; "R" focuses the reason box.
        await page.keyboard.press("r")
        await page.keyboard.type("tie 2 both")
        assert await page.locator("#answered").inner_text() == "2"
        await page.keyboard.press("Escape")
        await page.keyboard.press("t")
        await playwright_api.expect(page.locator("#answered")).to_have_text("3")
        assert (await recorded(db))[-1][1:] == (3, "tie 2 both")
        await browser.close()
    async with db.session() as session:
        assert int(await session.scalar(sa.select(sa.func.count()).select_from(OutboxEvent)) or 0) == 3
    # The one failed resource is the deliberate wrong-password 401; nothing else may fail
    # (no script errors, no Content-Security-Policy violations).
    assert [e for e in errors if "status of 401" not in e] == []
