"""Careless and hostile clients: every request bounded in what it may store and in what a
read answers (docs/server.md, "Safety")."""

from __future__ import annotations

import time
from typing import Any

import pytest
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.metrics import exposition
from zerowatch.server.settings import Settings


def _run(run_id: str, **fields: Any) -> dict[str, Any]:
    return {"run_id": run_id, "name": run_id, **fields}


@pytest.mark.parametrize("run_id", ["a/b", "a b", "a%2Fb", "../x", "-x", ".x", "x?y", "x#y", "é"])
def test_a_run_id_outside_the_safe_alphabet_is_refused_naming_it(client, run_id):
    r = client.post("/api/v1/runs", json=_run(run_id))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "run_id"]
    assert "letters, digits" in r.json()["detail"][0]["msg"]


@pytest.mark.parametrize("run_id", ["run-1a2b3c", "A.b_c-9", "7"])
def test_a_run_id_of_the_safe_alphabet_is_created_and_usable(client, run_id):
    assert client.post("/api/v1/runs", json=_run(run_id)).status_code == 201
    assert client.get(f"/api/v1/runs/{run_id}").status_code == 200


@pytest.mark.parametrize(
    "field,value,loc,limit",
    [
        ("name", "n" * 201, ["body", "name"], "200 characters"),
        ("project", "p" * 101, ["body", "project"], "100 characters"),
        ("tags", ["t"] * 65, ["body", "tags"], "64 entries"),
        ("tags", ["ok", "t" * 101], ["body", "tags", 1], "100 characters"),
        ("hosts", ["h" * 256], ["body", "hosts", 0], "255 characters"),
        ("job", "j" * 201, ["body", "job"], "200 characters"),
    ],
)
def test_a_new_runs_text_and_lists_are_bounded_naming_the_field(client, field, value, loc, limit):
    r = client.post("/api/v1/runs", json=_run("bounded", **{field: value}))
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    assert err["loc"] == loc and limit in err["msg"]
    assert client.get("/api/v1/runs/bounded").status_code == 404  # nothing stored


def test_131072_tags_are_refused_at_once(client):
    t0 = time.perf_counter()
    r = client.post("/api/v1/runs", json=_run("tagged", tags=[f"t{i}" for i in range(131072)]))
    print(f"\n131,072 tags refused in {time.perf_counter() - t0:.2f} s")
    # (more items than any body's list may hold: refused before validation)
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body", "tags"]


def test_metrics_of_5000_live_runs_is_bounded_in_runs_and_bytes(sqlite_url):
    db = Database.open(sqlite_url)
    now = time.time()
    rows = [{"run_id": f"r{i}", "name": "n" * 200, "project": "p", "tags": [], "status": "running",
             "zero_stage": 2, "offload_optimizer": "none", "offload_param": "none",
             "precision": "fp32", "world_size": 8, "engine": "zerowatch", "engine_info": {},
             "config": {}, "param_count": 1, "hosts": [], "torch_version": "", "job": "",
             "zerowatch_version": "", "theory": {}, "theory_comm": {}, "started_at": now,
             "created_at": now, "last_event_at": now - 5000 + i, "ended_at": None}
            for i in range(5000)]  # fmt: skip
    with db.write() as conn:
        conn.execute(m.runs.insert(), rows)
    settings = Settings(db_url=sqlite_url)
    t0 = time.perf_counter()
    body = exposition(db, grace_s=300, forget_after_s=86400, max_runs=settings.metrics_max_runs)
    print(f"\n/metrics of 5,000 live runs: {time.perf_counter() - t0:.2f} s, {len(body):,} bytes")
    text = body.decode()
    exposed = {line.split('run="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("zerowatch_run_info{")}  # fmt: skip
    # The most recently active runs, and the count of the others.
    assert exposed == {f"r{i}" for i in range(5000 - 256, 5000)}
    assert "zerowatch_metrics_runs_left_out 4744.0" in text
    assert len(body) < 2**20
    db.close()


# -- hosts, deletes, what an unauthenticated caller learns --------------------------------


@pytest.fixture
def hosted(sqlite_url):
    from fastapi.testclient import TestClient
    from zerowatch.server.app import create_app

    settings = Settings(db_url=sqlite_url, allowed_hosts="127.0.0.1,localhost,zw.example.org")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_a_host_the_server_does_not_answer_to_is_refused_before_any_route(hosted):
    evil = {"host": "evil.example"}
    assert hosted.post("/api/v1/runs", json=_run("r1")).status_code == 201
    assert hosted.get("/healthz").status_code == 200
    assert hosted.get("/healthz", headers={"host": "zw.example.org:8321"}).status_code == 200
    for method, path in (("GET", "/runs/r1"), ("GET", "/metrics"), ("DELETE", "/api/v1/runs/r1"),
                         ("POST", "/api/v1/runs/r1/events")):  # fmt: skip
        r = hosted.request(method, path, headers=evil, json={"run_id": "r1", "events": []})
        assert r.status_code == 400 and "Host" in r.json()["detail"], (method, path)
    assert hosted.get("/api/v1/runs/r1").status_code == 200  # nothing deleted


def test_redirects_name_no_host(hosted):
    assert hosted.post("/api/v1/runs", json=_run("r1")).status_code == 201
    r = hosted.get("/api/v1/runs/r1/", follow_redirects=False)
    assert r.status_code in (301, 307, 308) and r.headers["location"] == "/api/v1/runs/r1"


def test_a_delete_without_a_configured_token_is_refused_unless_allowed(sqlite_url):
    from fastapi.testclient import TestClient
    from zerowatch.server.app import create_app

    with TestClient(create_app(Settings(db_url=sqlite_url))) as c:
        assert c.post("/api/v1/runs", json=_run("r1")).status_code == 201
        r = c.delete("/api/v1/runs/r1")
        assert r.status_code == 403 and "ZEROWATCH_TOKEN" in r.json()["detail"]
        assert c.get("/api/v1/runs/r1").status_code == 200
    with TestClient(create_app(Settings(db_url=sqlite_url, allow_delete_without_token=True))) as c:
        assert c.delete("/api/v1/runs/r1").status_code == 200


def test_with_closed_reads_health_says_only_up_and_redoc_is_not_served(sqlite_url):
    from fastapi.testclient import TestClient
    from zerowatch.server.app import create_app

    closed = Settings(db_url=sqlite_url, token="s3cret", read_requires_token=True)
    with TestClient(create_app(closed)) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/redoc").status_code in (401, 404)
    with TestClient(create_app(Settings(db_url=sqlite_url))) as c:
        assert c.get("/healthz").json()["pid"] > 0  # open reads: the launcher's pid check
        assert c.get("/redoc").status_code == 404  # its script comes from a CDN the CSP refuses


# -- what one event may carry, and what one trace export answers --------------------------


def _post_steps(client, spec, run_id: str, n: int, mutate=None) -> Any:
    import dataclasses

    from zerowatch import events as ev
    from zerowatch import simulate

    client.post("/api/v1/runs", json=dataclasses.asdict(simulate.run_create(spec, run_id=run_id)))
    last = None
    for evs in simulate.steps(spec, n):
        body = [dataclasses.asdict(e) for e in evs]
        if mutate is not None:
            mutate(body)
        last = client.post(f"/api/v1/runs/{run_id}/events",
                           json={"schema_version": ev.SCHEMA_VERSION, "run_id": run_id,
                                 "events": body})  # fmt: skip
    return last


def test_a_step_with_more_spans_than_an_agent_sends_is_refused_naming_the_field(client):
    from zerowatch.server.checks import MAX_SPANS_PER_STEP

    from zerowatch import simulate

    def flood(body: list[dict[str, Any]]) -> None:
        one = {"name": "x", "cat": "phase", "start": 1.0, "end": 2.0, "args": {}}
        body[0]["spans"] = [one] * (MAX_SPANS_PER_STEP + 1)

    r = _post_steps(client, simulate.SimSpec(world_size=2, stage=2), "flood", 1, flood)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "events", 0, "spans"]
    assert client.get("/api/v1/runs/flood/ranks").json()["ranks"] == []  # nothing stored


def test_a_trace_export_stops_at_its_span_budget_and_says_so(sqlite_url):
    from fastapi.testclient import TestClient
    from zerowatch.server.app import create_app

    from zerowatch import simulate

    spec = simulate.SimSpec(world_size=4, stage=3, spans_every=1)
    with TestClient(create_app(Settings(db_url=sqlite_url, max_trace_spans=40))) as c:
        assert _post_steps(c, spec, "traced", 6).status_code == 200
        r = c.get("/api/v1/runs/traced/trace")
        assert r.status_code == 200
        meta = r.json()["metadata"]
        spans = [e for e in r.json()["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
        assert 0 < len(spans) <= 40
        assert meta["cut"]["spans_left_out"] > 0 and meta["cut"]["max_spans"] == 40
        assert (
            r.headers["x-zerowatch-trace-cut"] == f"{meta['cut']['spans_left_out']} spans left out"
        )
    with TestClient(create_app(Settings(db_url=sqlite_url))) as c:
        r = c.get("/api/v1/runs/traced/trace")
        assert r.json()["metadata"]["cut"] is None and "x-zerowatch-trace-cut" not in r.headers


# -- error bombs: a small body must not buy seconds of CPU and megabytes of answer ---------


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("n", [87_361, 16_384])
def test_a_gzip_of_empty_events_is_answered_at_once_with_a_bounded_answer(client, n):
    import gzip
    import json

    assert client.post("/api/v1/runs", json=_run("x")).status_code == 201
    body = gzip.compress(json.dumps({"run_id": "x", "events": [{}] * n}).encode())
    before, t0 = _rss_mb(), time.perf_counter()
    r = client.post("/api/v1/runs/x/events", content=body,
                    headers={"content-encoding": "gzip", "content-type": "application/json"})  # fmt: skip
    took, grew = time.perf_counter() - t0, _rss_mb() - before
    print(f"\n{n:,} empty events ({len(body)} bytes gzipped): {r.status_code} in {took:.2f} s, "
          f"answer {len(r.content):,} bytes, RSS +{grew:.0f} MB")  # fmt: skip
    detail = r.json()["detail"]
    if n > 16_384:  # more events than a batch may carry: refused before any is validated
        assert r.status_code == 413 and detail[0]["loc"] == ["body", "events"]
    else:  # each event is wrong: the first 20 errors, and the count of the others
        assert r.status_code == 422 and len(detail) == 21
        assert detail[0]["loc"][:3] == ["body", "events", 0]
        assert detail[-1]["type"] == "too_many_errors" and "more errors" in detail[-1]["msg"]
    assert len(r.content) < 10_000 and grew < 50
    assert client.get("/api/v1/runs/x/ranks").json()["ranks"] == []


def test_a_run_body_with_a_huge_list_is_refused_before_validation(client):
    r = client.post("/api/v1/runs", json=_run("big", tags=[1] * 131_072))
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body", "tags"]
    r = client.post("/api/v1/runs", json=_run("big", tags=[1] * 100))
    assert r.status_code == 422 and len(r.json()["detail"]) <= 21


def test_the_runs_list_and_its_page_are_paginated(sqlite_url):
    from fastapi.testclient import TestClient
    from zerowatch.server.app import create_app
    from zerowatch.server.pages import RUNS_PER_PAGE

    n = RUNS_PER_PAGE + 30
    db = Database.open(sqlite_url)
    now = time.time()
    rows = [{"run_id": f"r{i:04d}", "name": f"n{i}", "project": f"p{i}", "tags": [],
             "status": "finished", "zero_stage": 1, "offload_optimizer": "none",
             "offload_param": "none", "precision": "fp32", "world_size": 2,
             "engine": "zerowatch", "engine_info": {}, "config": {}, "param_count": 1,
             "hosts": [], "torch_version": "", "zerowatch_version": "", "theory": {},
             "theory_comm": {}, "started_at": now, "created_at": now + i, "job": "",
             "last_event_at": None, "ended_at": None} for i in range(n)]  # fmt: skip
    with db.write() as conn:
        conn.execute(m.runs.insert(), rows)
    db.close()
    with TestClient(create_app(Settings(db_url=sqlite_url))) as c:
        first = [r["run_id"] for r in c.get("/api/v1/runs?limit=20").json()["runs"]]
        second = [r["run_id"] for r in c.get("/api/v1/runs?limit=20&offset=20").json()["runs"]]
        assert first == [f"r{i:04d}" for i in range(n - 1, n - 21, -1)]
        assert second == [f"r{i:04d}" for i in range(n - 21, n - 41, -1)]
        page1 = c.get("/").text
        assert page1.count('href="/runs/r') >= RUNS_PER_PAGE and "r0000" not in page1
        assert 'href="/?page=2"' in page1 and 'rel="prev"' not in page1
        page2 = c.get("/?page=2").text
        assert "r0000" in page2 and 'href="/?page=1"' in page2 and 'rel="next"' not in page2
