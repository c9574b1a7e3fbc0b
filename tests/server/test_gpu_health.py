"""GPU health next to the step, on the server: the agent's NVML telemetry (read here through
a scripted pynvml, no GPU) stored per rank-step, rolled up, exposed in /metrics bounded per
run, and named by the doctor's straggler finding."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_nvml import FakeGpu, FakeNvml
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.probes import gpu as gpu_probe
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.metrics import exposition
from zerowatch.server.read import doctor, rollups, series
from zerowatch.server.read.rollups import RollupWorker

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=8, stage=2, num_params=50_000_000, spans_every=0)
SLOW = 5


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    yield database
    database.close()


def _store(db: Database, spec: simulate.SimSpec, n: int = 30, mutate=None) -> str:  # type: ignore[no-untyped-def]
    rc = simulate.run_create(spec)
    store.create_run(db, run=rc)
    for events in simulate.steps(spec, n):
        if mutate is not None:
            events = [mutate(e) for e in events]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    RollupWorker(db).flush()
    return rc.run_id


def _throttled_on(step: int) -> bool:
    return step % 5 in (0, 1)  # 40% of the steps


class ScriptedGpus:
    """Every rank's GPU read through the agent's own NVML reader over a scripted pynvml:
    rank SLOW's GPU hits its power cap (SM clock 1500 of 1980 MHz) in 40% of the steps."""

    def __init__(self, world: int, *, throttled_rank: int | None) -> None:
        self.cards = [FakeGpu(uuid=f"GPU-{r}") for r in range(world)]
        self.nvml = FakeNvml(self.cards)
        self.readers = [gpu_probe.NvmlReader(self.nvml, card, AgentHealth()) for card in self.cards]
        self.throttled_rank = throttled_rank

    def __call__(self, e: ev.StepEvent) -> ev.StepEvent:
        card = self.cards[e.rank]
        if e.rank == self.throttled_rank and _throttled_on(e.step):
            card.reasons, card.sm_clock, card.power_mw = 0x4, 1500, 700_000
        else:
            card.reasons, card.sm_clock, card.power_mw = 0, 1980, 520_000
        sample = self.readers[e.rank].sample()
        return dataclasses.replace(e, gpu=gpu_probe.summarize([sample], samples=1))


def _straggler(db: Database, run_id: str) -> dict:
    out = doctor.findings(db=db, run_id=run_id)
    assert out is not None
    (f,) = [f for f in out["findings"] if f["kind"] == "straggler"]
    return f


def test_a_throttled_slow_rank_is_named_throttled_in_the_straggler_finding(db: Database) -> None:
    spec = dataclasses.replace(SPEC, straggler_rank=SLOW, straggler_factor=1.5)
    run_id = _store(db, spec, mutate=ScriptedGpus(8, throttled_rank=SLOW))
    f = _straggler(db, run_id)
    assert f["ranks"] == [SLOW]
    lo, hi = f["steps"]
    share = sum(_throttled_on(s) for s in range(lo, hi + 1)) / (hi - lo + 1)
    g = f["evidence"]["gpu"]
    assert g["throttled_share"] == pytest.approx(share)
    assert g["reasons"] == {"sw_power_cap": pytest.approx(share)}
    assert f"its GPU was throttled (power cap) in {share:.0%} of those steps" in f[
        "message"
    ].replace("Its", "its")
    assert "power limit" in f["suggestion"] and "sim-node-0000" in f["message"]


def test_a_slow_rank_with_a_healthy_gpu_says_so_and_one_with_errors_says_that(
    db: Database,
) -> None:
    spec = dataclasses.replace(SPEC, straggler_rank=SLOW, straggler_factor=1.5)
    f = _straggler(db, _store(db, spec, mutate=ScriptedGpus(8, throttled_rank=None)))
    assert "unthrottled and without errors" in f["message"]
    assert f["evidence"]["gpu"]["throttled_share"] == 0
    assert "nvidia-smi -q -d PERFORMANCE)" not in f["suggestion"]
    erroring = dataclasses.replace(spec, gpu_error_rank=SLOW, gpu_errors_at=20)
    f = _straggler(db, _store(db, erroring))
    assert f["evidence"]["gpu"]["xid_errors"] == 10
    assert "reported 10 critical XID event(s) and 10 uncorrected ECC error(s)" in f["message"]
    assert "drain the node" in f["suggestion"]


def _families(text: str) -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, []).extend(fam.samples)
    return out


def test_metrics_expose_gpu_health_bounded_per_run(db: Database) -> None:
    spec = dataclasses.replace(SPEC, world_size=64, gpu_throttled_rank=17, gpu_error_rank=40,
                               gpu_errors_at=25, straggler_rank=17)  # fmt: skip
    run_id = _store(db, spec)
    text = exposition(db, grace_s=300).decode()
    fams = _families(text)

    def value(name: str, **labels: str) -> float:
        (v,) = [s.value for s in fams[name] if s.labels.get("run") == run_id
                and all(s.labels.get(k) == x for k, x in labels.items())]  # fmt: skip
        return v

    assert value("zerowatch_gpu_throttled_ranks") == 1
    xid = [s for s in fams["zerowatch_gpu_xid_errors"]
           if s.name.endswith("_total") and s.labels["run"] == run_id]  # fmt: skip
    ecc = [s for s in fams["zerowatch_gpu_ecc_errors"]
           if s.name.endswith("_total") and s.labels["run"] == run_id]  # fmt: skip
    assert [s.value for s in xid] == [5.0] and [s.value for s in ecc] == [5.0]  # steps 25-29
    assert value("zerowatch_gpu_sm_clock_ratio", stat="min") == 0.75
    assert value("zerowatch_gpu_sm_clock_ratio", stat="p50") == 1.0
    assert value("zerowatch_gpu_throttled_ratio", stat="max") == 1.0
    assert value("zerowatch_gpu_temperature_celsius", stat="max") == 84.0
    assert value("zerowatch_gpu_power_limit_ratio", stat="max") == 1.0
    # The straggler is an outlier rank: its own GPU series, throttled.
    assert value("zerowatch_gpu_sm_clock_ratio", rank="17") == 0.75
    per_rank = {s.labels.get("rank") for s in fams["zerowatch_gpu_sm_clock_ratio"]} - {None, ""}
    assert len(per_rank) <= 8
    gpu_lines = [ln for ln in text.splitlines() if ln.startswith("zerowatch_gpu") and run_id in ln]
    assert len(gpu_lines) <= 5 * (5 + 8) + 3


def test_a_run_without_gpu_telemetry_exposes_no_gpu_series(db: Database) -> None:
    run_id = _store(db, SPEC, n=5)
    text = exposition(db, grace_s=300).decode()
    assert not [ln for ln in text.splitlines() if ln.startswith("zerowatch_gpu") and run_id in ln]


def test_gpu_fields_roll_up_and_read_per_rank(db: Database) -> None:
    spec = dataclasses.replace(SPEC, gpu_throttled_rank=3, gpu_throttle_reasons=0x40)
    run_id = _store(db, spec, n=6)
    with db.read() as conn:
        pk = conn.exec_driver_sql("select id from runs where run_id = ?", (run_id,)).scalar()
        got = rollups.read(conn, pk, ["gpu.throttled", "gpu.reason.hw_thermal_slowdown",
                                      "gpu.sm_clock_ratio"])  # fmt: skip
        rows = series.rank_rows(conn, pk, "gpu.throttled", ranks=[3, 4], step_from=4, step_to=5)
        reason = series.rank_rows(
            conn, pk, "gpu.reason.hw_thermal_slowdown", ranks=[3], step_from=5, step_to=5
        )
    st = got["gpu.throttled"][5]
    assert (st.n, st.mean * st.n, st.max_rank) == (8, 1.0, 3)
    assert got["gpu.reason.hw_thermal_slowdown"][5].max_rank == 3
    assert got["gpu.sm_clock_ratio"][5].min == 0.75
    assert sorted(rows) == [(3, 4, 1.0), (3, 5, 1.0), (4, 4, 0.0), (4, 5, 0.0)]
    assert reason == [(3, 5, 1.0)]
