"""Screenshots of the pages: $ZEROWATCH_ARTIFACTS/screenshots (default: artifacts/screenshots
in the repository); the dashboards' conftest lists them at the end of the run."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(os.environ.get("ZEROWATCH_ARTIFACTS", REPO / "artifacts")) / "screenshots"
XSS_NAME = "<script>alert(1)</script>"
TAKEN: list[Path] = []  # what this run saved


def screenshot(page, name: str) -> Path:  # type: ignore[no-untyped-def]
    """Save a full-page screenshot as SCREENSHOTS/name.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    TAKEN.append(path)
    return path
