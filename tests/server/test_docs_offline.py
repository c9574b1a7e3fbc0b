"""The OpenAPI page at /docs works without internet: Swagger UI comes from the installed
bundle, and real headless Chromium that may fetch nothing but the server draws every
operation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.live_server import LiveServer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip

pytestmark = pytest.mark.slow


def test_docs_page_renders_every_operation_offline() -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: run .ci/system-deps")
    from playwright.sync_api import sync_playwright

    with LiveServer() as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        outside: list[str] = []
        errors: list[str] = []

        def route(r):  # type: ignore[no-untyped-def]
            if r.request.url.startswith(server.url):
                r.continue_()
            else:  # no internet: anything not from the server fails
                outside.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=30_000)
        paths = page.locator(".opblock-summary-path").all_inner_texts()
        browser.close()
    assert outside == [] and errors == []
    assert any("/api/v1/runs/{run_id}/events" in x for x in paths), paths
    assert len(paths) >= 12
