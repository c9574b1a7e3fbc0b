"""Real headless Chromium (Debian's /usr/bin/chromium) driven by Playwright.

One Playwright driver per test session: Playwright's sync API cannot run two drivers at
once in one thread, so every test that needs a browser takes the session-wide `browser`
fixture (tests/conftest.py) instead of starting its own.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: Flags that work on these machines (no sandbox as root, no network chatter).
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@contextmanager
def launch_chromium() -> Iterator[Any]:
    """Start Playwright and Chromium; yields the Browser, closes both on exit."""
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"chromium not found at {CHROMIUM}: run .ci/system-deps")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()
