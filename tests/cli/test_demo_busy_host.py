"""The demo's summary says when the host was busy (contended), from the same figure the
run page's finding states: the doctor's `basis.contention` over its findings API."""

from __future__ import annotations

import json

import httpx

from zerowatch.demo import StageRun, busy_host_note


def _findings(contention: float | None) -> dict[str, object]:
    """/api/v1/runs/{id}/findings as the server answers it for a demo run (abridged)."""
    basis = {} if contention is None else {"state_overhead": 1.0, "contention": contention}
    return {"findings": [
        {"kind": "stage_choice", "severity": "info", "message": "…", "prediction":
         {"change": "reduce_bucket_size = 524,288", "basis": basis}},
        {"kind": "exposed_communication", "severity": "warning", "message": "…",
         "prediction": None},
    ]}  # fmt: skip


def _client(by_run: dict[str, float | None]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        run_id = request.url.path.split("/")[4]
        if run_id not in by_run:
            return httpx.Response(404, json={"detail": "no such run"})
        return httpx.Response(200, content=json.dumps(_findings(by_run[run_id])))

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="http://zw")


def test_summary_warns_when_a_run_shared_its_host_and_names_how_much():
    runs = [StageRun(1, "t1", run_id="a"), StageRun(2, "t2", run_id="b"),
            StageRun(3, "t3", run_id="c")]  # fmt: skip
    note = busy_host_note(_client({"a": 1.55, "b": 2.17, "c": 1.04}), runs)
    assert note is not None and note.startswith("The host was busy")
    assert "ZeRO-1 1.55x, ZeRO-2 2.17x" in note and "ZeRO-3" not in note
    assert "may not rank the stages" in note


def test_summary_says_nothing_on_a_quiet_host_or_without_the_figure():
    runs = [StageRun(1, "t1", run_id="a"), StageRun(2, "t2", run_id="b"),
            StageRun(3, "t3", run_id="gone")]  # fmt: skip
    assert busy_host_note(_client({"a": 1.02, "b": None}), runs) is None
