"""The pages under their Content-Security-Policy in a real headless Chromium: every page
draws with no console error and no policy violation, the security headers are on every
answer, and script injected into a page (as if escaping had failed) does not run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from charts import assert_all_drawn
from support.screenshots import XSS_NAME

from zerowatch import simulate as sim

pytestmark = pytest.mark.slow

#: Markup placed where escaping would have to fail for it to run: a script element, an
#: inline event handler and a javascript: link.
INJECTED = (
    '<script>window.__zwInjected = "script"</script>'
    '<img src="/favicon.ico?x" onload="window.__zwInjected = \'onload\'">'
    '<a id="zw-js-link" href="javascript:window.__zwInjected = \'link\'">x</a>'
)
#: Run before a page's own scripts: records every policy violation the page meets.
NOT_FOUND = "the server responded with a status of 404 (Not Found)"
VIOLATIONS_JS = """
window.__zwViolations = [];
document.addEventListener('securitypolicyviolation',
  e => window.__zwViolations.push(e.violatedDirective + ' ' + e.blockedURI));
"""


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str]]:
    from support.dashboard_runs import post_simulated_run
    from support.live_server import LiveServer

    with LiveServer(settings={"stalled_after_s": 10**7}) as server:
        spec = sim.SimSpec(name=XSS_NAME, tags=("<img src=x onerror=alert(2)>",), world_size=4,
                           stage=3, precision="fp16", straggler_rank=1, seed=5)  # fmt: skip
        yield server, post_simulated_run(server.url, spec, 12, end="finished")


def _pages(run_id: str) -> list[tuple[str, bool]]:
    """(path, draws charts?) of every page kind."""
    host = sim.host_of(sim.SimSpec(world_size=4), 1)
    return [("/", False), (f"/runs/{run_id}", True), (f"/runs/{run_id}/ranks/1", True),
            (f"/runs/{run_id}/hosts/{host}", True), (f"/compare?runs={run_id}", True),
            ("/plan", True), ("/runs/%3Cscript%3Ealert(5)%3C%2Fscript%3E", False)]  # fmt: skip


def test_every_answer_carries_the_security_headers(served) -> None:
    server, run_id = served
    for path in ("/", f"/runs/{run_id}", "/static/zerowatch.js", "/api/v1/runs", "/metrics",
                 "/healthz", "/docs", "/runs/nope"):  # fmt: skip
        h = httpx.get(server.url + path, timeout=30).headers
        csp = h["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
        assert "unsafe-eval" not in csp and "script-src 'self' 'unsafe-inline'" not in csp
        assert h["x-content-type-options"] == "nosniff", path
        assert h["x-frame-options"] == "DENY", path
        assert h["referrer-policy"] == "same-origin", path


def test_pages_draw_under_the_policy_without_violations(served, probe) -> None:
    server, run_id = served
    page = probe.page
    page.add_init_script(VIOLATIONS_JS)
    for path, draws in _pages(run_id):
        resp = page.goto(server.url + path)
        if draws:
            assert_all_drawn(page)
        else:
            page.wait_for_load_state("load")
        assert page.evaluate("window.__zwViolations") == [], path
        if resp.status == 404:  # the unknown run's page: the browser logs the 404 itself
            assert probe.errors == [f"Failed to load resource: {NOT_FOUND}"]
            probe.errors.clear()
    page.goto(server.url + "/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=30_000)
    assert page.evaluate("window.__zwViolations") == []
    assert probe.errors == [] and probe.dialogs == []


def test_script_injected_into_a_page_does_not_run(served, probe) -> None:
    """The run page as the server sent it (its headers kept), with markup spliced into its
    body: the policy refuses the inline script, the event handler and the javascript: link,
    and the page's own charts still draw."""
    server, run_id = served
    page = probe.page
    page.add_init_script(VIOLATIONS_JS)

    def inject(route) -> None:  # type: ignore[no-untyped-def]
        resp = route.fetch()
        route.fulfill(response=resp, body=resp.text().replace("<main>", "<main>" + INJECTED))

    page.route(f"{server.url}/runs/{run_id}", inject)
    page.goto(f"{server.url}/runs/{run_id}")
    assert_all_drawn(page)
    page.locator("#zw-js-link").click()
    page.wait_for_function("() => document.querySelector('main img').complete")
    assert page.evaluate("window.__zwInjected") is None
    page.wait_for_function("() => window.__zwViolations.length >= 3", timeout=5_000)
    blocked = page.evaluate("window.__zwViolations")
    assert all(v.startswith("script-src") for v in blocked), blocked
    # What the browser said: only the refusals, nothing else went wrong.
    assert probe.errors and all("Content Security Policy" in e for e in probe.errors), probe.errors
    assert probe.dialogs == []
