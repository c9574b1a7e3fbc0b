"""The OpenAPI page at /docs works without internet: Swagger UI comes from the installed
bundle, and real headless Chromium that may fetch nothing but the server draws every
operation."""

from __future__ import annotations

from typing import Any

import pytest
from support.live_server import LiveServer

pytestmark = pytest.mark.slow


def test_docs_page_renders_every_operation_offline(browser: Any) -> None:
    with LiveServer() as server:
        context = browser.new_context()
        page = context.new_page()
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
        context.close()
    assert outside == [] and errors == []
    assert any("/api/v1/runs/{run_id}/events" in x for x in paths), paths
    assert len(paths) >= 12
