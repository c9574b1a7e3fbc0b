"""Bad requests get a 4xx that names the field, and change nothing that is stored; the
token guards ingest and delete (and reads when configured)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.server_api import asdict, batch_body, create_sim_run, gz, post_events
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2, stage=3)
JSON_GZ = {"Content-Encoding": "gzip", "Content-Type": "application/json"}


def _stored(client: TestClient, run_id: str) -> list[tuple[int, int, int]]:
    run = client.get(f"/api/v1/runs/{run_id}").json()
    return [(r["rank"], r["steps"], r["last_step"]) for r in run["ranks"]]


@pytest.fixture
def run_id(client: TestClient) -> str:
    rid = create_sim_run(client, SPEC)
    for evs in simulate.steps(SPEC, 3):
        assert post_events(client, rid, evs).json() == {"accepted": 2, "duplicates": 0}
    return rid


def test_create_is_201_then_200_and_events_are_idempotent(client: TestClient) -> None:
    rc = simulate.run_create(SPEC)
    assert client.post("/api/v1/runs", json=asdict(rc)).status_code == 201
    assert client.post("/api/v1/runs", json=asdict(rc)).status_code == 200
    evs = [simulate.step_event(SPEC, r, 0) for r in range(2)]
    assert post_events(client, rc.run_id, evs).json() == {"accepted": 2, "duplicates": 0}
    assert post_events(client, rc.run_id, evs).json() == {"accepted": 0, "duplicates": 2}
    plain = client.post(f"/api/v1/runs/{rc.run_id}/events", json=batch_body(rc.run_id, evs))
    assert plain.json() == {"accepted": 0, "duplicates": 2}


def _detail_names(resp, field: str) -> bool:  # type: ignore[no-untyped-def]
    return field in json.dumps(resp.json())


@pytest.mark.parametrize(
    ("name", "mutate", "status", "field"),
    [
        ("schema_version", lambda b: b.update(schema_version=2), 422, "schema_version"),
        ("run_id mismatch", lambda b: b.update(run_id="other"), 422, "run_id"),
        ("missing step_time_s", lambda b: b["events"][0].pop("step_time_s"), 422, "step_time_s"),
        ("string step", lambda b: b["events"][0].update(step="ten"), 422, "step"),
        ("rank outside world", lambda b: b["events"][1].update(rank=7), 422, "rank"),
        ("bad op", lambda b: b["events"][0]["collectives"][0].update(op="all_to_all"), 422, "op"),
        (
            "short buckets",
            lambda b: b["events"][0]["collectives"][0].update(buckets=[1]),
            422,
            "buckets",
        ),
        ("huge int", lambda b: b["events"][0].update(samples=10**30), 422, "64 bits"),
        ("unknown kind", lambda b: b["events"][0].update(kind="nope"), 422, "kind"),
    ],
)
def test_bad_batches_get_422_naming_the_field(
    client: TestClient,
    run_id: str,
    name: str,
    mutate,
    status: int,
    field: str,  # type: ignore[no-untyped-def]
) -> None:
    before = _stored(client, run_id)
    body = batch_body(run_id, [simulate.step_event(SPEC, r, 3) for r in range(2)])
    mutate(body)
    resp = client.post(f"/api/v1/runs/{run_id}/events", content=gz(body), headers=JSON_GZ)
    assert resp.status_code == status, (name, resp.text)
    assert _detail_names(resp, field), resp.text
    assert _stored(client, run_id) == before


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused(client: TestClient, run_id: str, token: str) -> None:
    text = json.dumps(batch_body(run_id, [simulate.step_event(SPEC, 0, 3)]))
    text = text.replace('"exposed_comm_s": ', f'"exposed_comm_s": {token}, "_x": ', 1)
    resp = client.post(f"/api/v1/runs/{run_id}/events", content=gzip.compress(text.encode()),
                       headers=JSON_GZ)  # fmt: skip
    assert resp.status_code == 422, resp.text
    assert "finite" in resp.text or "range" in resp.text
    assert _stored(client, run_id) == [(0, 3, 2), (1, 3, 2)]


def test_non_finite_from_the_python_side_is_refused(client: TestClient, run_id: str) -> None:
    """Even when the number parses (a config value of 1e308 * 10 is inf), validation holds."""
    e = simulate.step_event(SPEC, 0, 3)
    body = batch_body(run_id, [e])
    body["events"][0]["grad_norm"] = "nan"  # pydantic would read the string as NaN
    resp = client.post(f"/api/v1/runs/{run_id}/events", json=body)
    assert resp.status_code == 422 and "grad_norm" in resp.text


def test_malformed_json_bad_gzip_unknown_run_and_size_limit(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", max_batch_bytes=20_000)
    with TestClient(create_app(settings)) as client:
        rid = create_sim_run(client, SPEC)
        url = f"/api/v1/runs/{rid}/events"
        r = client.post(url, content=b'{"run_id": ', headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "json" in r.text.lower()
        r = client.post(url, content=b"not gzip at all", headers=JSON_GZ)
        assert r.status_code == 400 and "gzip" in r.text
        r = client.post(url, content=gzip.compress(b'{"a": 1}')[:-6], headers=JSON_GZ)
        assert r.status_code == 400 and "gzip" in r.text
        r = post_events(client, "no-such-run", [simulate.step_event(SPEC, 0, 0)])
        assert r.status_code == 404 and "no-such-run" in r.text
        big = [simulate.step_event(SPEC, r, s) for s in range(10) for r in range(2)]
        r = client.post(url, json=batch_body(rid, big))
        assert r.status_code == 413 and "max_batch_bytes" in r.text
        # a small gzip that inflates past the limit (a gzip bomb) is refused as well
        bomb = gzip.compress(b" " * 200_000)
        assert len(bomb) < 20_000
        r = client.post(url, content=bomb, headers=JSON_GZ)
        assert r.status_code == 413
        r = client.post(url, content=b"\x00\xff", headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 422)
        r = client.post(url, content=json.dumps({"run_id": rid, "events": [], "n": "a\u0000b"}),
                        headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 422 and "NUL" in r.text
        assert client.get(f"/api/v1/runs/{rid}").json()["ranks"] == []


def test_bad_run_create_names_the_field(client: TestClient) -> None:
    rc = asdict(simulate.run_create(SPEC))
    for field, value in [("schema_version", 9), ("world_size", 0), ("zero_stage", 4),
                         ("precision", "fp8"), ("run_id", "")]:  # fmt: skip
        r = client.post("/api/v1/runs", json={**rc, field: value})
        assert r.status_code == 422, (field, r.text)
        assert field in r.text
    text = json.dumps({**rc, "config": {"lr": float("inf")}})  # Python writes Infinity
    assert "Infinity" in text
    r = client.post("/api/v1/runs", content=text, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "finite" in r.text
    assert client.get("/api/v1/runs").json() == {"runs": []}


def test_query_parameters_are_checked(client: TestClient, run_id: str) -> None:
    base = f"/api/v1/runs/{run_id}"
    assert client.get(base + "/series", params={"metric": "nope"}).status_code == 422
    assert "metric" in client.get(base + "/series", params={"metric": "nope"}).text
    assert (
        client.get(base + "/series", params={"metric": "loss", "max_points": 1}).status_code == 422
    )
    assert client.get(base + "/series", params={"metric": "loss", "rank": -1}).status_code == 422
    assert client.get(base + "/trace", params={"steps": "a:b"}).status_code == 422
    assert client.get("/api/v1/runs", params={"status": "sleepy"}).status_code == 422
    assert client.get("/api/v1/runs/none/series", params={"metric": "loss"}).status_code == 404
    assert client.get("/api/v1/compare", params={"runs": ","}).status_code == 422


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", token="s3cret")
    with TestClient(create_app(settings)) as c:
        yield c


def test_token_guards_ingest_and_delete(guarded: TestClient) -> None:
    rc = asdict(simulate.run_create(SPEC))
    assert guarded.post("/api/v1/runs", json=rc).status_code == 401
    r = guarded.post("/api/v1/runs", json=rc, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 403
    ok = {"Authorization": "Bearer s3cret"}
    assert guarded.post("/api/v1/runs", json=rc, headers=ok).status_code == 201
    evs = [simulate.step_event(SPEC, 0, 0)]
    assert post_events(guarded, rc["run_id"], evs).status_code == 401
    assert post_events(guarded, rc["run_id"], evs, {"Authorization": "Bearer x"}).status_code == 403
    assert post_events(guarded, rc["run_id"], evs, ok).json()["accepted"] == 1
    assert guarded.get(f"/api/v1/runs/{rc['run_id']}").status_code == 200  # reads are open
    assert guarded.delete(f"/api/v1/runs/{rc['run_id']}").status_code == 401
    assert (
        guarded.delete(
            f"/api/v1/runs/{rc['run_id']}", headers={"Authorization": "Bearer x"}
        ).status_code
        == 403
    )
    assert guarded.get(f"/api/v1/runs/{rc['run_id']}").json()["ranks"][0]["steps"] == 1
    assert guarded.delete(f"/api/v1/runs/{rc['run_id']}", headers=ok).status_code == 200
    assert guarded.get(f"/api/v1/runs/{rc['run_id']}").status_code == 404


def test_reads_can_require_the_token(tmp_path: Path) -> None:
    settings = Settings(
        db_url=f"sqlite:///{tmp_path / 'z.db'}", token="s3cret", read_requires_token=True
    )
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/v1/runs").status_code == 401
        assert c.get("/api/v1/runs", headers={"Authorization": "Bearer bad"}).status_code == 403
        assert c.get("/api/v1/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # /metrics names runs and projects: closed with the other reads
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer bad"}).status_code == 403
        ok = c.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.text.startswith("# HELP")
        assert c.get("/healthz").status_code == 200


def test_hostile_strings_are_refused_or_stored_on_both_databases(db_url: str) -> None:
    """What PostgreSQL cannot store (NUL, lone surrogates) is a 4xx, never a 500; odd but
    valid text (quotes, markup, non-ASCII) round-trips as data."""
    with TestClient(create_app(Settings(db_url=db_url))) as c:
        rc = asdict(simulate.run_create(SPEC))
        hdr = {"Content-Type": "application/json"}
        for text in ('"a\\u0000b"', '"\\ud800x"'):
            body = json.dumps({**rc, "name": "PLACEHOLDER"}).replace('"PLACEHOLDER"', text)
            r = c.post("/api/v1/runs", content=body, headers=hdr)
            assert r.status_code == 422, r.text
        assert c.get("/api/v1/runs", params={"project": "a\x00b"}).status_code == 400
        assert c.get("/api/v1/runs/a%00b").status_code == 400
        odd = "<script>alert('x')</script> \"ünï\" ✓ 😀"
        r = c.post("/api/v1/runs", json={**rc, "name": odd, "tags": [odd], "config": {odd: odd}})
        assert r.status_code == 201
        got = c.get(f"/api/v1/runs/{rc['run_id']}").json()
        assert (got["name"], got["tags"], got["config"]) == (odd, [odd], {odd: odd})
        assert c.get("/api/v1/runs", params={"tag": odd}).json()["runs"][0]["name"] == odd
        assert c.get("/api/v1/runs/" + "x" * 300).status_code == 422


def _values(client: TestClient, run_id: str, metric: str) -> list[tuple[int, list, list]]:
    got = client.get(
        f"/api/v1/runs/{run_id}/series", params={"metric": metric, "ranks": "0-63"}
    ).json()
    return [(s["rank"], s["steps"], s["values"]) for s in got["series"]]


def test_a_replay_or_a_second_create_carrying_other_values_changes_nothing_stored(
    client: TestClient, run_id: str
) -> None:
    """(run, rank, seq) and run_id are the identities: whatever a repeat carries, the values
    stored first stay as they were."""
    run_before = client.get(f"/api/v1/runs/{run_id}").json()
    times_before = _values(client, run_id, "step_time_s")
    norms_before = _values(client, run_id, "grad_norm")
    replay = [simulate.step_event(SPEC, r, s) for s in range(3) for r in range(2)]
    for e in replay:
        e.step_time_s, e.grad_norm = 99.0, 1234.5
    assert post_events(client, run_id, replay).json() == {"accepted": 0, "duplicates": 6}
    again = {**asdict(simulate.run_create(SPEC, run_id=run_id)), "name": "other",
             "project": "elsewhere", "tags": ["new"], "config": {"lr": 1.0}}  # fmt: skip
    assert client.post("/api/v1/runs", json=again).status_code == 200
    assert _values(client, run_id, "step_time_s") == times_before
    assert _values(client, run_id, "grad_norm") == norms_before
    assert 99.0 not in [v for _, _, vs in times_before for v in vs]  # the replay differed
    run_after = client.get(f"/api/v1/runs/{run_id}").json()
    for key in ("name", "project", "tags", "config", "ranks", "world_size", "zero_stage"):
        assert run_after[key] == run_before[key], key


@pytest.mark.parametrize("path", ["series", "heatmap"])
def test_an_unknown_series_metric_is_a_422_naming_the_metric(
    client: TestClient, run_id: str, path: str
) -> None:
    r = client.get(f"/api/v1/runs/{run_id}/{path}", params={"metric": "teleport_s"})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "metric"]
    assert "teleport_s" in r.json()["detail"][0]["msg"]
