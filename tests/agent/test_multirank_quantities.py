"""Two gloo ranks of the real engine at stages 0-3 (with accumulation, overlap, offload and
bf16), instrumented while the real server is down from the start: every quantity is in the
spool, agrees with the theory and the engine, and `upload` then stores every step once."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
from rank_jobs import CASES, instrumented_stages
from support.engine_harness import run_ranks
from support.live_server import LiveServer
from zerowatch.agent.spool import read_events, segments
from zerowatch.agent.upload import upload_spool

from zerowatch import events as ev
from zerowatch import theory

pytestmark = pytest.mark.slow

WORLD, STEPS = 2, 4


def _spooled(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for seg in segments(run_dir / f"rank-{rank:05d}"):
        out.extend(obj for _, obj in read_events(seg))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory):
    spool_root = tmp_path_factory.mktemp("spool")
    with LiveServer() as server:
        server.stop()  # down from the start: the agents only ever see a refused connection
        results = run_ranks(instrumented_stages, WORLD, str(spool_root), server.url, STEPS,
                            timeout_s=120)  # fmt: skip
        events = {
            name: [_spooled(spool_root / results[0][name]["run_id"], r) for r in range(WORLD)]
            for name in CASES
        }
        server.start()
        upload = upload_spool(spool_root, server.url)
        yield {"results": results, "events": events, "upload": upload, "server": server,
               "spool_root": spool_root}  # fmt: skip


def _steps(job: dict[str, Any], name: str, rank: int) -> list[dict[str, Any]]:
    return [e for e in job["events"][name][rank] if e["kind"] == "step"]


@pytest.mark.parametrize("name", list(CASES))
def test_every_quantity_is_recorded_per_step_and_rank(job, name):
    res0 = job["results"][0][name]
    assert job["results"][1][name]["run_id"] == res0["run_id"]  # one run for the job
    stage = res0["zero_stage"]
    offload = "offload" in name
    for rank in range(WORLD):
        events = job["events"][name][rank]
        assert [e["seq"] for e in events] == list(range(STEPS + 1))
        assert events[-1]["kind"] == "end" and events[-1]["status"] == "finished"
        steps = _steps(job, name, rank)
        assert [e["step"] for e in steps] == list(range(STEPS))
        for e in steps:
            assert e["rank"] == rank and e["step_time_s"] > 0
            phases = e["phases"]
            want = {"forward", "backward", "optimizer_step", "other", "backward_inner"}
            want |= {"param_gather"} if stage == 3 else set()
            want |= {"offload_d2h", "offload_h2d"} if offload else set()
            want |= {"grad_reduce"}
            assert want <= set(phases), f"{name}: missing phases {want - set(phases)}"
            ops = {c["op"] for c in e["collectives"] if c["purpose"] != "other"}
            assert ops == set(
                theory.comm_bytes_per_step(
                    res0["num_parameters"], WORLD, stage, persistent_params=res0["persistent"]
                )
            )
            for c in e["collectives"]:
                assert c["count"] >= 1 and c["bytes"] > 0 and c["world_size"] == WORLD
                assert sum(c["buckets"]) == c["count"]
                assert len(c["buckets"]) == len(ev.LATENCY_BUCKETS) + 1
                assert 0 < c["latency_max_s"] <= c["latency_sum_s"]
                assert c["algbw_bytes_per_s"] == pytest.approx(c["bytes"] / c["latency_sum_s"])
                factor = ev.bus_bandwidth_factor(c["op"], WORLD)
                assert c["busbw_bytes_per_s"] == pytest.approx(c["algbw_bytes_per_s"] * factor)
            total_latency = sum(c["latency_sum_s"] for c in e["collectives"])
            assert 0 < e["exposed_comm_s"] <= total_latency + 1e-6
            if offload:
                dirs = {o["direction"]: o for o in e["offload"]}
                assert set(dirs) == {"d2h", "h2d"}
                assert all(o["bytes"] > 0 and o["bandwidth_bytes_per_s"] > 0 for o in dirs.values())
            else:
                assert e["offload"] == []
            assert (
                e["grad_norm"] is not None and math.isfinite(e["grad_norm"]) and e["grad_norm"] > 0
            )
            assert isinstance(e["clipped"], bool) and not e["nonfinite"] and not e["skipped"]
            assert e["lr"] == pytest.approx(1e-2)
            assert e["loss"] is not None and 2.0 < e["loss"] < 5.0
            ga = res0["ga"]
            assert e["samples"] == 2 * ga and e["tokens"] == 2 * ga * 8
            assert e["samples_per_s"] == pytest.approx(e["samples"] / e["step_time_s"])
            assert e["tokens_per_s"] == pytest.approx(e["tokens"] / e["step_time_s"])
            assert (e["spans"] is not None) == (e["step"] % 2 == 0)
        spans = steps[0]["spans"]
        assert {s["cat"] for s in spans} >= {"phase", "collective"}
        assert all(s["start"] <= s["end"] for s in spans)


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_per_collective_agree_with_theory(job, name):
    res0 = job["results"][0][name]
    want = theory.comm_bytes_per_step(
        res0["num_parameters"], WORLD, res0["zero_stage"], precision=res0["precision"],
        gradient_accumulation_steps=res0["ga"], persistent_params=res0["persistent"],
    )  # fmt: skip
    for rank in range(WORLD):
        for e in _steps(job, name, rank):
            got: dict[str, int] = {}
            for c in e["collectives"]:
                if c["purpose"] != "other":  # grad norm, loss-scale agreement: not model state
                    got[c["op"]] = got.get(c["op"], 0) + c["bytes"]
            assert set(got) == set(want)
            for op, size in want.items():
                assert abs(got[op] - size) <= 0.10 * size, (
                    f"{name} rank {rank} {op}: {got[op]} vs {size}"
                )


@pytest.mark.parametrize("name", list(CASES))
def test_phase_times_add_up_to_the_step_time(job, name):
    gaps = []
    for rank in range(WORLD):
        for e in _steps(job, name, rank):
            p = e["phases"]
            top = p["forward"] + p["backward"] + p["optimizer_step"]
            assert top + p["other"] == pytest.approx(e["step_time_s"], rel=1e-6)
            assert top <= e["step_time_s"] * (1 + 1e-6)
            gaps.append(p["other"] / e["step_time_s"])
            # Nested phases fit in their parents.
            assert p["grad_reduce"] <= p["backward"] + p["optimizer_step"] + 1e-6
            assert p["backward_inner"] <= p["backward"] + 1e-9
    # Forward, backward and optimizer step cover the step: the rest (the loop's own code:
    # loss.item(), run.log, the next micro-batch) is a few percent.
    assert statistics.median(gaps) < 0.05, gaps
    assert max(gaps) < 0.25, gaps


@pytest.mark.parametrize("name", list(CASES))
def test_memory_reported_is_what_the_engine_holds(job, name):
    for rank in range(WORLD):
        res = job["results"][rank][name]
        for e in _steps(job, name, rank):
            mem = e["memory"]
            assert mem["device"] == "cpu"
            assert mem["model_state"] == res["model_state"]  # the engine's own tensors
            assert mem["model_state_theory"] == res["theory"]
            for kind, want in res["theory"].items():
                got = mem["model_state"].get(kind, 0)
                assert abs(got - want) <= 0.10 * want + 64, f"{name} {kind}: {got} vs {want}"
            assert set(mem["peak_by_phase"]) == {"forward", "backward", "optimizer_step"}
            total = sum(mem["model_state"].values())
            assert mem["rss_peak_bytes"] >= max(mem["peak_by_phase"].values()) > total


def test_server_down_from_the_start_then_upload_stores_every_step_once(job):
    upload, server = job["upload"], job["server"]
    assert upload.ok, upload.summary()
    n_events = len(CASES) * WORLD * (STEPS + 1)
    assert (upload.events, upload.accepted, upload.duplicates) == (n_events, n_events, 0)
    for name in CASES:
        run_id = job["results"][0][name]["run_id"]
        run = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        res0 = job["results"][0][name]
        assert run["status"] == "finished"
        assert (run["name"], run["world_size"], run["zero_stage"]) == (
            name,
            WORLD,
            res0["zero_stage"],
        )
        assert (
            run["precision"] == res0["precision"] and run["param_count"] == res0["num_parameters"]
        )
        assert run["offload_optimizer"] == ("cpu" if "offload" in name else "none")
        assert run["config"]["zero_optimization"]["stage"] == res0["zero_stage"]
        # The creation names no hosts: each rank's events name its own.
        assert run["hosts"] == [] and run["torch_version"] and run["zerowatch_version"]
        assert run["theory"] == res0["theory"]
        ranks = {r["rank"]: r for r in run["ranks"]}
        assert sorted(ranks) == list(range(WORLD))
        for r in ranks.values():
            assert (r["steps"], r["last_step"], r["end_status"]) == (STEPS, STEPS - 1, "finished")
            assert r["dropped_events"] == 0 and r["agent_errors"] == 0
            assert r["host"]
    again = upload_spool(job["spool_root"], server.url)
    assert again.ok and (again.accepted, again.duplicates) == (0, n_events)


@pytest.mark.parametrize("name", list(CASES))
def test_exclusive_parts_add_up_to_the_step_time(job, name):
    exposed_comm = 0.0
    for rank in range(WORLD):
        for e in _steps(job, name, rank):
            parts, p, step = e["parts"], e["phases"], e["step_time_s"]
            assert set(parts) == set(ev.STEP_PARTS)
            assert min(parts.values()) >= 0.0, parts
            assert abs(sum(parts.values()) - step) <= max(0.01 * step, 2e-4), (parts, step)
            # Each part is the self time of its phase: never more than the phase, and the
            # gap outside every phase is the phases' `other`.
            assert parts["forward_compute"] <= p["forward"] + 1e-9
            assert parts["backward_compute"] <= p["backward"] + 1e-9
            assert parts["exposed_param_gather"] <= p.get("param_gather", 0.0) + 1e-9
            assert parts["exposed_grad_reduce"] <= p.get("grad_reduce", 0.0) + 1e-9
            assert parts["other"] == pytest.approx(p["other"], abs=1e-6)
            # What compute hid is wall time some collective ran while compute went on.
            assert 0.0 <= e["hidden_comm_s"] <= step + 1e-6, (e["hidden_comm_s"], step)
            exposed_comm += parts["exposed_param_gather"] + parts["exposed_grad_reduce"]
    assert exposed_comm > 0.0  # every case communicates inside the step
