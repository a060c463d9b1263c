"""The console in headless Chromium (Debian's ``chromium``, driven by Playwright) at
1280x800, against a real broker with real data and the console served by uvicorn: every
page loads without horizontal overflow, the lag chart draws, a lookup finds a sent
message, a DLQ resend moves a message, an offset reset asks and then moves offsets.

Screenshots go to ``$ONCEQ_CONSOLE_SCREENSHOTS`` (default: the test's temp dir)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from onceq import Admin
from onceq.console import ConsoleConfig, create_app
from onceq.protocol.codes import retry_topic
from tests.console.world import GROUP, TOPIC, TRACED, World
from tests.helpers import free_port

playwright_api = pytest.importorskip("playwright.async_api")
uvicorn = pytest.importorskip("uvicorn")

VIEWPORT = {"width": 1280, "height": 800}


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: scripts/test.sh installs it "
                    "(scripts/chromium.sh)")
    return exe


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("ONCEQ_CONSOLE_SCREENSHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
async def site(world: World) -> AsyncIterator[str]:
    """The console served over HTTP by uvicorn, on the broker's event loop."""
    port = free_port()
    app = create_app(ConsoleConfig(broker=world.addr, metrics_url=world.metrics_url,
                                   port=port, refresh_ms=300))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the console did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def page(site):
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium(),
                                           args=["--no-sandbox", "--disable-gpu"])
        try:
            p = await browser.new_page(viewport=VIEWPORT)
            p.set_default_timeout(10_000)
            yield p
        finally:
            await browser.close()


async def fits(page) -> None:
    """Nothing is cut off sideways at 1280 px (no horizontal scrolling)."""
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= VIEWPORT["width"], f"{page.url} is {width} px wide"


async def visit(page, url: str, shots: Path, name: str) -> None:
    r = await page.goto(url)
    assert r is not None and r.status == 200, url
    assert "Traceback" not in await page.content()
    await fits(page)
    await page.screenshot(path=str(shots / f"{name}.png"))
    await page.screenshot(path=str(shots / f"{name}-full.png"), full_page=True)


async def test_every_page_loads_and_the_lag_chart_draws(page, site, shots):
    for name, path in [("overview", "/"), ("topics", "/topics"),
                       ("topic", f"/topics/{TOPIC}"), ("groups", "/groups"),
                       ("messages", "/messages"),
                       ("browse", f"/messages/browse?topic={TOPIC}&queue=1&count=10"),
                       ("duplicates", "/duplicates"), ("dlq-list", "/dlq"),
                       ("dlq", f"/dlq/{GROUP}")]:
        await visit(page, site + path, shots, name)
    assert await page.locator("#letters tr").count() == 3  # header and two letters
    # the group page: its live panel is refreshed while open, each refresh a sample
    await visit(page, f"{site}/groups/{GROUP}", shots, "group-first")
    await page.wait_for_function(
        "document.querySelector('#lag svg.chart polyline.series') !== null"
        " && document.querySelector('#lag svg.chart polyline.series')"
        ".getAttribute('points').split(' ').length >= 3")
    box = await page.locator("#lag svg.chart").bounding_box()
    assert box is not None and box["width"] > 600 and box["height"] > 150
    assert box["x"] + box["width"] <= VIEWPORT["width"]
    assert await page.locator("#total-lag").inner_text() == "20"
    await fits(page)
    await page.screenshot(path=str(shots / "group.png"))
    # the overview's live panel refreshes too: a rate appears
    await page.goto(site + "/")
    await page.wait_for_function("/\\d\\/s/.test(document.querySelector('#rate-in').innerText)")
    await page.screenshot(path=str(shots / "overview-live.png"))
    await visit(page, f"{site}/duplicates?group={TRACED}", shots, "duplicates-group")
    assert "rebalance" in await page.locator("#recent").inner_text()


async def test_lookup_finds_a_sent_message_and_a_dlq_resend_moves_one(page, site, world,
                                                                      shots):
    await page.goto(site + "/messages")
    await page.fill("input[name=topic]", TOPIC)
    await page.select_option("select[name=by]", "keys")
    await page.fill("input[name=key]", "order-5")
    await page.click("#lookup button[type=submit]")
    await page.wait_for_load_state()
    body = await page.locator("main").inner_text()
    assert world.keys["order-5"] in body and f"{TOPIC}[1]@1" in body
    assert "billing (consumed)" in body and "bad order 1" in body
    await fits(page)
    await page.screenshot(path=str(shots / "lookup.png"), full_page=True)

    await page.goto(f"{site}/dlq/{GROUP}")
    await page.locator("#letters tr", has_text="bad order 0").locator("button").click()
    await page.wait_for_selector("#confirm")
    assert "Resend the dead letter at offset 0" in await page.locator("h1").inner_text()
    await page.screenshot(path=str(shots / "dlq-confirm.png"))
    async with Admin(world.addr) as a:  # asked, not done
        assert retry_topic(GROUP) not in {t["topic"] for t in await a.list_topics()}
    await page.click("#confirm")
    await page.wait_for_selector("#resent")
    assert f"%RETRY%{GROUP}[0]@0" in await page.locator("#resent").inner_text()
    await page.screenshot(path=str(shots / "dlq-done.png"))
    async with Admin(world.addr) as a:
        assert await a.queue_offsets(retry_topic(GROUP), 0) == (0, 1)


async def test_offset_reset_asks_for_confirmation_then_moves_the_offsets(page, site, world,
                                                                         shots):
    await page.goto(f"{site}/groups/{GROUP}")
    await page.select_option("#reset select[name=mode]", "offset")
    await page.fill("#reset input[name=value]", "8")
    await page.click("#reset button[type=submit]")
    await page.wait_for_selector("#plan")
    assert "Reset group billing on orders?" in await page.locator("h1").inner_text()
    assert await page.locator("#plan tr").count() == 5
    await fits(page)
    await page.screenshot(path=str(shots / "reset-confirm.png"))
    async with Admin(world.addr) as a:
        assert await a.group_offset(GROUP, TOPIC, 0) == 5  # not moved before the confirm
    await page.click("#confirm")
    await page.wait_for_selector("#moved")
    await page.screenshot(path=str(shots / "reset-done.png"))
    async with Admin(world.addr) as a:
        assert [await a.group_offset(GROUP, TOPIC, q) for q in range(4)] == [8] * 4
    # bad input is a message on the page
    await page.goto(f"{site}/groups/{GROUP}")
    await page.fill("#reset input[name=value]", "eight")
    await page.click("#reset button[type=submit]")
    await page.wait_for_selector("#error")
    assert "offset: 'eight' is not a whole number" in await page.locator("#error").inner_text()
    await page.screenshot(path=str(shots / "reset-bad-input.png"))
