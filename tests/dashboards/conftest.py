"""Fixtures of the dashboards' browser tests: a real headless Chromium (Debian's, driven by
Playwright, never downloaded), a live zerowatch server holding real instrumented runs of ZeRO
stages 1, 2 and 3 (torchrun, gloo, the bundled engine) plus a run whose name is markup, and
the folder screenshots go to.

Screenshots: $ZEROWATCH_ARTIFACTS/screenshots (default: artifacts/screenshots in the
repository); the path is printed at the end of the test session.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from support.dashboard_runs import REAL_RUNS, REAL_STEPS
from support.screenshots import SCREENSHOTS, TAKEN, XSS_NAME

from zerowatch import simulate as sim


@pytest.fixture(autouse=True)
def _plotly_checks_every_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Figures built in these tests have plotly check every property (pages skip that)."""
    from zerowatch.dashboards import theme

    monkeypatch.setattr(theme, "VALIDATE", True)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if TAKEN:
        terminalreporter.write_line(f"dashboards: {len(TAKEN)} screenshots in {SCREENSHOTS}")


@dataclass
class Seeded:
    """A live server and the runs it holds. The real runs train while the first test of the
    module watches one of them live; `stages` waits for them to end."""

    server: object
    training: object
    xss: str = ""
    failed: str = ""

    @property
    def stages(self) -> dict[int, str]:
        """Stage -> run id of the real runs, once they have ended."""
        return self.training.wait()  # type: ignore[attr-defined,no-any-return]

    @property
    def url(self) -> str:
        return self.server.url  # type: ignore[attr-defined,no-any-return]


@dataclass
class PageProbe:
    """A browser page that records console errors, page errors and dialogs."""

    page: object
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)


@pytest.fixture
def probe(browser) -> Iterator[PageProbe]:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    out = PageProbe(page=page)
    page.on("console", lambda m: out.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: out.errors.append(f"page error: {e}"))

    def on_dialog(d) -> None:  # type: ignore[no-untyped-def]
        out.dialogs.append(d.message)
        d.dismiss()

    page.on("dialog", on_dialog)
    yield out
    context.close()


def seed_runs(server_url: str) -> tuple[str, str]:
    """Post (through the ingest API) a run whose name, project, tags and config are markup,
    and a failed run; returns their ids."""
    from support.dashboard_runs import post_simulated_run

    xss_spec = sim.SimSpec(name=XSS_NAME, project="<b>markup</b>", tags=("<img src=x onerror=alert(2)>",),
                           world_size=2, stage=1, seed=9)  # fmt: skip
    xss = post_simulated_run(
        server_url, xss_spec, 10,
        config={"note": "</script><script>alert(3)</script>", "zero_optimization": {"stage": 1}},
    )  # fmt: skip
    failed_spec = sim.SimSpec(name="diverged run", project="other", world_size=2, stage=2, seed=4)
    failed = post_simulated_run(server_url, failed_spec, 6, end="failed")
    return xss, failed


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> Iterator[Seeded]:  # type: ignore[no-untyped-def]
    from support.dashboard_runs import start_real_runs
    from support.live_server import LiveServer

    with LiveServer(settings={"stalled_after_s": 3600}) as server:
        training = start_real_runs(server.url, REAL_RUNS, steps=REAL_STEPS,
                                   log_dir=tmp_path_factory.mktemp("training"))  # fmt: skip
        try:
            xss, failed = seed_runs(server.url)
            yield Seeded(server=server, training=training, xss=xss, failed=failed)
        finally:
            training.stop()
