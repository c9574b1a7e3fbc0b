"""The ingest route's fast path (server/ingest_path.py) stores a valid batch without the
FastAPI route, and hands everything else to the route, which answers exactly as before."""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from zerowatch.server.app import create_app
from zerowatch.server.ingest_path import IngestFastPath
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2)
TOKEN = "s3cret"


@pytest.fixture
def routed(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, list[str]]]:
    """A client of an app with a token, and the paths the FastAPI app behind the fast path
    was asked to answer."""
    seen: list[str] = []
    app = create_app(Settings(db_url=sqlite_url, token=TOKEN, max_batch_bytes=200_000))
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with TestClient(app, headers=headers) as c:
        layer = app.middleware_stack
        while not isinstance(layer, IngestFastPath):
            layer = layer.app
        inner = layer.app

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope.get("path", ""))
            await inner(scope, receive, send)

        monkeypatch.setattr(layer, "app", counted)
        rc = simulate.run_create(SPEC, run_id="fast")
        assert c.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
        seen.clear()
        yield c, seen


def _body(events: list[ev.StepEvent], run_id: str = "fast") -> bytes:
    return orjson.dumps(dataclasses.asdict(ev.EventBatch(run_id, events)))  # type: ignore[arg-type]


def test_a_valid_batch_is_stored_without_the_route(routed: tuple[TestClient, list[str]]) -> None:
    c, seen = routed
    events = [simulate.step_event(SPEC, r, s) for r in range(2) for s in range(3)]
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    r = c.post("/api/v1/runs/fast/events", content=gzip.compress(_body(events)), headers=headers)
    assert r.status_code == 200 and r.json() == {"accepted": 6, "duplicates": 0}
    assert r.headers["x-content-type-options"] == "nosniff"  # the app's headers still apply
    r = c.post("/api/v1/runs/fast/events", content=_body(events[:2]))  # a replay
    assert r.json() == {"accepted": 0, "duplicates": 2}
    assert seen == []
    ranks = c.get("/api/v1/runs/fast/ranks").json()["ranks"]
    assert [x["steps"] for x in ranks] == [3, 3]


def test_everything_else_is_answered_by_the_route(routed: tuple[TestClient, list[str]]) -> None:
    c, seen = routed
    good = _body([simulate.step_event(SPEC, 0, 0)])
    bad_rank = _body([simulate.step_event(dataclasses.replace(SPEC, world_size=9), 7, 0)])
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"content": good, "headers": {"Authorization": ""}}, 401, "token"),
        ({"content": good, "headers": {"Authorization": "Bearer nope"}}, 403, "wrong token"),
        ({"content": b'{"run_id": "fast", "events": [{"kind": "step"}]}'}, 422, "rank"),
        ({"content": b'{"run_id": NaN}'}, 422, "NaN"),
        ({"content": good, "headers": {"Content-Type": "text/plain"}}, 422, ""),
        ({"content": good, "headers": {"Content-Type": ""}}, 422, ""),
        ({"content": good, "headers": {"Content-Encoding": "gzip"}}, 400, "gzip"),
        ({"content": good, "headers": {"Content-Encoding": "br"}}, 415, "br"),
        ({"content": b"x" * 200_001}, 413, "max_batch_bytes"),
        ({"content": bad_rank}, 422, "world_size"),
    ]
    for kwargs, status, says in cases:
        seen.clear()
        r = c.post("/api/v1/runs/fast/events", **kwargs)
        assert r.status_code == status, (kwargs.get("headers"), r.text)
        assert says in r.text
        assert seen == ["/api/v1/runs/fast/events"], (kwargs.get("headers"), seen, status)
    seen.clear()
    r = c.post("/api/v1/runs/nope/events", content=_body([simulate.step_event(SPEC, 0, 0)], "nope"))
    assert r.status_code == 404 and "nope" in r.text
    assert seen == ["/api/v1/runs/nope/events"]
    ranks = c.get("/api/v1/runs/fast/ranks").json()["ranks"]
    assert sum(x["steps"] for x in ranks) == 0  # nothing of the refused batches was stored
