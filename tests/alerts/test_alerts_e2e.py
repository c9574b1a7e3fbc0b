"""End to end: a real Prometheus loads the rendered rules, scrapes a live zerowatch server
fed simulated runs, and raises ZeroWatchStepTimeRegression for the run whose step time
regresses, ZeroWatchRunStalled for the run that stops sending, ZeroWatchGpuThrottled for
the run one of whose GPUs stays throttled, ZeroWatchGpuErrors for the run one of whose
GPUs starts reporting XID and ECC errors (the GPU telemetry as the agents send it) and
ZeroWatchCollectiveHang for the run whose ranks' heartbeats show one node's ranks out of the
collective the others wait in.

The rules are rendered with windows of seconds (the settings an operator would shrink),
Prometheus scrapes and evaluates every second, and the simulated runs post one step every
0.25 s in real time, so the whole test takes about 20-30 s.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_server import LiveServer
from support.prometheus import PrometheusError, PrometheusServer, prometheus
from zerowatch.alerts import ALERT_NAMES, RULES_PATH, AlertSettings, render_rules

from zerowatch import events as ev
from zerowatch.simulate import SimSpec, heartbeats, run_create, step_event

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WINDOW_S, OFFSET_S = 4, 8
SETTINGS = AlertSettings.load(
    None,
    [
        f"window={WINDOW_S}s", f"step_time_baseline_offset={OFFSET_S}s",
        "step_time_regression_for=2s", "stall_after=4s", "stall_for=1s",
        "gpu_throttled_for=2s", f"gpu_errors_window={WINDOW_S}s", "collective_hang_for=1s",
    ],
)  # fmt: skip
STEP_EVERY_S = 0.25


class SimulatedRun:
    """Posts one step of every rank of `spec` to the server every STEP_EVERY_S, in a thread,
    until stopped or `max_steps` is reached (then it goes quiet without ending: a stall).
    `regress_now()` makes the step time regress from the next step on."""

    def __init__(self, server: LiveServer, spec: SimSpec, *, max_steps: int | None = None):
        self.server, self.spec, self.max_steps = server, spec, max_steps
        self.run_id = uuid.uuid4().hex
        self.step = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=spec.name)
        self._client = httpx.Client(base_url=server.api, timeout=10.0)

    def create(self) -> None:
        body = dataclasses.asdict(run_create(self.spec, run_id=self.run_id))
        resp = self._client.post("/runs", json=body)
        assert resp.status_code == 201, resp.text

    def regress_now(self) -> int:
        """Regress from the next step; returns that step."""
        at = self.step + 1
        self.spec = dataclasses.replace(self.spec, regress_at=at)
        return at

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self.max_steps is not None and self.step >= self.max_steps:
                return
            events = [step_event(self.spec, r, self.step) for r in range(self.spec.world_size)]
            batch = ev.EventBatch(run_id=self.run_id, events=list(events))
            try:
                resp = self._client.post(
                    f"/runs/{self.run_id}/events", json=dataclasses.asdict(batch)
                )
                if resp.status_code != 200:
                    self.errors.append(f"step {self.step}: {resp.status_code} {resp.text[:300]}")
            except httpx.HTTPError as e:
                self.errors.append(f"step {self.step}: {e!r}")
            self.step += 1
            next_at += STEP_EVERY_S
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> SimulatedRun:
        self.create()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()


def _alerts_by_run(prom: PrometheusServer) -> dict[tuple[str, str], dict[str, Any]]:
    return {(a["labels"]["alertname"], a["labels"].get("run", "")): a for a in prom.alerts()}


def test_prometheus_raises_regression_and_stall_alerts_from_a_live_server(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(SETTINGS))

    server = LiveServer()
    runs: list[SimulatedRun] = []
    # Prometheus first: it waits a few seconds before its first scrape anyway, which the
    # server's start-up overlaps.
    with (
        prometheus(targets=[f"{server.url}/metrics"], rule_files=[rules]) as prom,
        server,
    ):
        try:
            # The server serves the shipped default rules.
            served = httpx.get(f"{server.api}/alerts/rules.yml", timeout=10)
            assert served.status_code == 200
            assert served.text == RULES_PATH.read_text()

            groups = prom.rules()
            assert all(r["health"] != "err" for g in groups for r in g["rules"]), groups
            assert len(groups) == len(ALERT_NAMES)  # a group of each alert, all loaded

            regressing = SimulatedRun(
                server, SimSpec(name="regressing", project="e2e", step_time_s=0.5, seed=1)
            ).start()
            stalling = SimulatedRun(
                server, SimSpec(name="stalling", project="e2e", seed=2), max_steps=8
            ).start()
            throttled = SimulatedRun(
                server, SimSpec(name="throttled", project="e2e", gpu_throttled_rank=1, seed=3)
            ).start()
            erroring = SimulatedRun(
                server,
                SimSpec(name="erroring", project="e2e", gpu_error_rank=0, gpu_errors_at=12, seed=4),
            ).start()
            # 16 ranks on 2 nodes; at step 6 the second node's ranks stay in their loader
            # while the first node's wait in the step's first collective (their heartbeats).
            hang_spec = SimSpec(name="hanging", project="e2e", world_size=16, seed=5, hang_at=6,
                                hang_ranks=tuple(range(8, 16)))  # fmt: skip
            hanging = SimulatedRun(server, hang_spec, max_steps=6).start()
            runs += [regressing, stalling, throttled, erroring, hanging]

            # Let Prometheus hold a baseline one offset long, then regress.
            step_time = f'zerowatch_step_time_seconds{{run="{regressing.run_id}"}}'
            try:
                prom.wait_for(lambda: prom.query(f"{step_time} offset {OFFSET_S}s"), timeout=30)
            except PrometheusError as e:  # say what the server held and exposed
                exposed = httpx.get(f"{server.url}/metrics", timeout=10).text
                lines = [x for x in exposed.splitlines() if regressing.run_id in x]
                log = server.log_path.read_text()[-3000:] if server.log_path.exists() else ""
                pytest.fail(
                    f"{e}\nsteps posted {regressing.step}, errors {regressing.errors[:3]}"
                    f"\n/metrics lines of the run: {len(lines)}: {lines[:5]}"
                    f"\nserver log tail:\n{log}"
                )
            regress_at = regressing.regress_now()

            def both_alerts() -> dict[tuple[str, str], dict[str, Any]]:
                got = _alerts_by_run(prom)
                want = [
                    ("ZeroWatchStepTimeRegression", regressing.run_id),
                    ("ZeroWatchRunStalled", stalling.run_id),
                    ("ZeroWatchGpuThrottled", throttled.run_id),
                    ("ZeroWatchGpuErrors", erroring.run_id),
                    ("ZeroWatchCollectiveHang", hanging.run_id),
                    ("ZeroWatchRunStalled", hanging.run_id),
                ]
                if hanging.step >= 6 and not hung_posted:
                    beats = {"heartbeats": [dataclasses.asdict(b) for b in heartbeats(hang_spec)]}
                    resp = httpx.post(f"{server.api}/runs/{hanging.run_id}/heartbeats",
                                      json=beats, timeout=10)  # fmt: skip
                    assert resp.status_code == 200, resp.text
                    hung_posted.append(True)
                return got if all(k in got for k in want) else {}

            hung_posted: list[bool] = []

            try:
                alerts = prom.wait_for(both_alerts, timeout=25)
            except PrometheusError as e:
                pytest.fail(f"alerts now: {sorted(_alerts_by_run(prom))}\n{e}")
        finally:
            for run in runs:
                run.stop()

        for run in runs:
            assert not run.errors, run.errors[:3]
        assert stalling.step == 8 and regressing.step > regress_at

        regression = alerts[("ZeroWatchStepTimeRegression", regressing.run_id)]
        assert regression["state"] in ("pending", "firing")
        assert regression["labels"]["project"] == "e2e"
        assert regression["labels"]["severity"] == "warning"
        assert float(regression["value"]) > 1.1
        # Annotations name the run by the name the server exports, and by its id.
        assert (
            f"run regressing (id {regressing.run_id}, project e2e)"
            in (regression["annotations"]["summary"])
        )
        assert f"over the last {WINDOW_S}s" in regression["annotations"]["description"]

        stall = alerts[("ZeroWatchRunStalled", stalling.run_id)]
        assert stall["state"] in ("pending", "firing")
        assert stall["labels"]["severity"] == "critical"
        assert float(stall["value"]) > 4
        assert (
            f"Run stalling (id {stalling.run_id}, project e2e)" in stall["annotations"]["summary"]
        )

        gpu = alerts[("ZeroWatchGpuThrottled", throttled.run_id)]
        assert gpu["labels"]["severity"] == "warning" and float(gpu["value"]) == 1
        assert f"1 GPUs of run throttled (id {throttled.run_id}" in gpu["annotations"]["summary"]
        hang = alerts[("ZeroWatchCollectiveHang", hanging.run_id)]
        assert hang["labels"]["severity"] == "critical" and float(hang["value"]) == 8
        assert f"Run hanging (id {hanging.run_id}" in hang["annotations"]["summary"]
        errors = alerts[("ZeroWatchGpuErrors", erroring.run_id)]
        assert errors["labels"]["severity"] == "critical" and float(errors["value"]) > 0
        assert (
            f"GPU errors in run erroring (id {erroring.run_id}" in errors["annotations"]["summary"]
        )

        # Nothing else fired on these healthy-otherwise runs: no regression of the run that
        # stalled, no stall of the run that kept sending, no GPU alert of a run without
        # GPU trouble, no other alert.
        assert set(alerts) == {
            ("ZeroWatchStepTimeRegression", regressing.run_id),
            ("ZeroWatchRunStalled", stalling.run_id),
            ("ZeroWatchGpuThrottled", throttled.run_id),
            ("ZeroWatchGpuErrors", erroring.run_id),
            # The hung run stopped sending steps: it is also a stalled run.
            ("ZeroWatchCollectiveHang", hanging.run_id),
            ("ZeroWatchRunStalled", hanging.run_id),
        }, sorted(alerts)

    assert time.monotonic() - started < 60
