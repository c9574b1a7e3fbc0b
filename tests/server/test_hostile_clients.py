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
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "tags"]


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
