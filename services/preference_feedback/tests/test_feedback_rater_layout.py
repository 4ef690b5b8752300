"""The rater's screen at a laptop's 1280×800 and a phone's 390×844, in a real headless Chromium
(Playwright): when an item opens, the conversation shows its last human turn (the one both
responses answer), long answers scroll inside their panes while every choice button stays on
screen, the progress indicator is readable, and the guidelines are open on the first item of a
session and collapsed (one click away) after. Screenshots are written for a person to look at
(``FORGE_SCREENSHOT_DIR``, else the test's temporary folder)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import AsyncIterator
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from argon2 import PasswordHasher

from forge_kit.db import Database
from forge_kit.http import HttpServer, make_app
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.seeds import PreferencePair, read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.web import rater_ui

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="pip install -e 'services/preference_feedback[browser]'"
)
pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PASSWORD = "correct horse battery"
VIEWPORTS = {"laptop": (1280, 800), "phone": (390, 844)}
BUTTONS = ("#choose-a", "#choose-b", "#choose-tie", "#choose-both-bad")


def long_pairs(hh_root: Path, count: int) -> list[PreferencePair]:
    """Real HH-RLHF conversations of at least three human turns, their two responses made long
    (each repeated as paragraphs) so that they cannot fit their panes."""
    chosen = [p for p in read_hh_rlhf(hh_root) if p.prompt.count("Human:") >= 3]
    return [
        PreferencePair(
            p.source, p.key, p.prompt, "\n\n".join([p.chosen] * 15), "\n\n".join([p.rejected] * 15)
        )
        for p in islice(chosen, count)
    ]


@pytest.fixture
async def base_url(db: Database, hh_root: Path) -> AsyncIterator[str]:
    service = FeedbackService(
        db, lease=dt.timedelta(seconds=60), hasher=PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
    )
    await service.seed_comparisons(long_pairs(hh_root, 6), limit=6, rng_seed=0)
    for name in VIEWPORTS:
        await service.create_rater(name, PASSWORD)
    app = make_app("preference_feedback")
    app.include_router(
        rater_ui(service, RewardModelRegistry(db), secure_cookies=False, session_max_age_s=3600)
    )
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


async def box(page: Any, selector: str) -> dict[str, float]:
    found = await page.locator(selector).bounding_box()
    assert found is not None, selector
    return dict(found)


async def assert_item_layout(page: Any, width: int, height: int) -> None:
    # Every choice button is on screen without scrolling the page.
    for button in BUTTONS:
        b = await box(page, button)
        assert (
            b["y"] >= 0 and b["y"] + b["height"] <= height and b["x"] >= 0 and b["x"] + b["width"] <= width
        ), (
            button,
            b,
        )
    # The conversation box is on screen and opens on its last human turn.
    prompt, last = await box(page, "#prompt-box"), await box(page, "#last-turn")
    assert 0 <= prompt["y"] < height, prompt
    assert prompt["y"] - 1 <= last["y"] < prompt["y"] + prompt["height"], (prompt, last)
    assert (await page.locator("#last-turn").inner_text()).startswith("Human:")
    # Long answers scroll inside their panes.
    for pane in ("#response-a", "#response-b"):
        inside = await page.locator(pane).evaluate("e => [e.scrollHeight, e.clientHeight]")
        assert inside[0] > inside[1] > 0, (pane, inside)
    # The progress bar spans the width and can be read.
    bar = await box(page, "#progress-bar")
    assert bar["height"] >= 12 and bar["width"] >= 0.8 * min(width, 1280) - 40, bar


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
@pytest.mark.parametrize("device", list(VIEWPORTS))
async def test_the_last_turn_the_buttons_and_the_progress_are_on_screen(
    base_url: str, device: str, tmp_path: Path
) -> None:
    width, height = VIEWPORTS[device]
    shots = Path(os.environ.get("FORGE_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": width, "height": height})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        await page.goto(f"{base_url}/ui/login")
        await page.get_by_label("Rater name").fill(device)
        await page.get_by_label("Password").fill(PASSWORD)
        await page.get_by_role("button", name="Log in").click()
        await page.wait_for_url("**/ui/rate")
        await page.wait_for_load_state()

        # The first item of the session: the guidelines are open.
        await playwright_api.expect(page.locator("#guidelines")).to_be_visible()
        await assert_item_layout(page, width, height)
        await page.screenshot(path=str(shots / f"rater-{device}-first.png"))

        # The next item: the guidelines are collapsed, one click away; the layout holds.
        await page.locator("#choose-a").click()
        await page.wait_for_selector("#recorded")
        await page.wait_for_load_state()
        assert await page.locator("#answered").inner_text() == "1"
        await playwright_api.expect(page.locator("#guidelines")).to_be_hidden()
        await assert_item_layout(page, width, height)
        await page.screenshot(path=str(shots / f"rater-{device}-next.png"))
        await page.locator("#guidelines-title").click()
        await playwright_api.expect(page.locator("#guidelines")).to_be_visible()
        await browser.close()
    assert errors == []
