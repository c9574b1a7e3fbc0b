"""The doctor's findings over HTTP: the JSON route, the run page (escaped, linking to the
evidence's chart) and `zerowatch doctor` (the terminal view of the same route)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from zerowatch import cli, simulate
from zerowatch import events as ev


def _post(client: TestClient, spec: simulate.SimSpec, host: str | None = None) -> str:
    rc = simulate.run_create(spec)
    assert client.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
    events = [e for step in simulate.steps(spec, 20) for e in step]
    if host is not None:
        events = [dataclasses.replace(e, host=host) for e in events]
    body = {"schema_version": ev.SCHEMA_VERSION, "run_id": rc.run_id,
            "events": [dataclasses.asdict(e) for e in events]}  # fmt: skip
    assert client.post(f"/api/v1/runs/{rc.run_id}/events", json=body).status_code == 200
    return rc.run_id


HOSTILE = "<script>alert(1)</script>"
SPEC = simulate.SimSpec(name=HOSTILE, world_size=4, stage=2, straggler_rank=2,
                        straggler_factor=1.6, spans_every=0)  # fmt: skip


def test_findings_route_answers_most_severe_first_and_404_for_an_unknown_run(
    client: TestClient,
) -> None:
    run_id = _post(client, SPEC)
    got = client.get(f"/api/v1/runs/{run_id}/findings")
    assert got.status_code == 200
    found = got.json()["findings"]
    assert found[0]["kind"] == "straggler" and found[0]["ranks"] == [2]
    for key in ("kind", "severity", "ranks", "steps", "message", "suggestion", "evidence",
                "prediction"):  # fmt: skip
        assert key in found[0]
    assert client.get("/api/v1/runs/nope/findings").status_code == 404


def test_the_run_page_shows_the_findings_escaped_with_a_link_to_the_evidence(
    client: TestClient,
) -> None:
    run_id = _post(client, SPEC, host=HOSTILE)
    page = client.get(f"/runs/{run_id}").text
    assert 'id="findings"' in page and 'data-kind="straggler"' in page
    assert 'href="#chart-ranks"' in page and 'id="chart-ranks"' in page
    assert HOSTILE not in page and "&lt;script&gt;" in page


def test_zerowatch_doctor_prints_the_findings_and_exits_by_severity(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = _post(client, SPEC)

    def get(server: str, path: str, **params: str) -> Any:
        resp = client.get(path, params=params or None)
        if resp.status_code >= 400:
            cli.fail(f"{resp.status_code} from {server}{path}")
        return resp.json()

    monkeypatch.setattr(cli, "_get", get)
    runner = CliRunner()
    out = runner.invoke(cli.app, ["doctor", run_id])
    assert out.exit_code == 0, out.output
    assert "[WARNING] straggler ranks 2" in out.output
    assert runner.invoke(cli.app, ["doctor", run_id, "--fail-on", "warning"]).exit_code == 1
    assert runner.invoke(cli.app, ["doctor", run_id, "--fail-on", "critical"]).exit_code == 0
    assert runner.invoke(cli.app, ["doctor", run_id, "--fail-on", "nope"]).exit_code == 2
    assert runner.invoke(cli.app, ["doctor", "missing"]).exit_code == 1


def test_steps_with_and_without_cpu_times_both_ingest_and_only_the_measured_are_read(
    client: TestClient,
) -> None:
    """An older agent's events carry no thread_cpu_s / other_cpu_s (the keys are absent): they
    are stored as before; a newer agent's steps are read as their metrics."""
    spec = dataclasses.replace(SPEC, straggler_rank=None, name="cpu")
    rc = simulate.run_create(spec)
    assert client.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
    old, new = [], []
    for step in simulate.steps(spec, 10):
        for e in step:
            if e.step < 5:
                d = dataclasses.asdict(e)
                del d["thread_cpu_s"], d["other_cpu_s"]
                old.append(d)
            else:
                new.append(dataclasses.asdict(
                    dataclasses.replace(e, thread_cpu_s=0.02, other_cpu_s=0.004)))  # fmt: skip
    for events in (old, new):
        body = {"schema_version": ev.SCHEMA_VERSION, "run_id": rc.run_id, "events": events}
        assert client.post(f"/api/v1/runs/{rc.run_id}/events", json=body).status_code == 200
    got = client.get(f"/api/v1/runs/{rc.run_id}/series", params={"metric": "other_cpu_s"}).json()
    assert got["steps"] == [5, 6, 7, 8, 9]
    assert got["stats"]["p50"] == [pytest.approx(0.004)] * 5
