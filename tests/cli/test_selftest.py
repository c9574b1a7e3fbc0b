"""`zerowatch selftest` on 2 gloo ranks: the engine matches AdamW at every stage, the
collectives' bandwidths keep nccl-tests' relation, the clocks of one machine agree within
the round trip, the report reaches a server; and the engine check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support.live_server import LiveServer

from zerowatch import selftest

#: Small sizes and few steps: a launch takes about 10 s on 2 cores.
FAST = ["--steps", "3", "--sizes", "64KiB,256KiB", "--warmup", "2", "--iters", "5",
        "--agent-steps", "5", "--clock-rounds", "8"]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    return dict(env, OMP_NUM_THREADS="1", COLUMNS="200")


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=cwd, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_torchrun_on_2_cpu_ranks_passes_and_reports_every_section(tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", "-m", "zerowatch.selftest", "--json", "out.json",
                 *FAST], tmp_path)  # fmt: skip
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["pass"] is True
    assert report["world"]["world_size"] == 2
    assert report["world"]["backend"] == "gloo"
    assert report["world"]["hosts"] == 1

    stages = report["engine"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    assert all(s["pass"] and s["max_rel_error"] < 1e-4 for s in stages), stages

    rows = report["collectives"]
    assert {(c["op"], c["bytes"]) for c in rows} == {
        (op, size) for op in selftest.OPS for size in (64 * 2**10, 256 * 2**10)
    }
    factors = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}
    for c in rows:
        assert c["time_s"] > 0 and c["busbw_Bps"] > 0, c
        assert c["busbw_Bps"] / c["algbw_Bps"] == pytest.approx(factors[c["op"]]), c
        assert c["algbw_Bps"] == pytest.approx(c["bytes"] / c["time_s"]), c

    clocks = report["clocks"]["ranks"]
    assert [c["rank"] for c in clocks] == [0, 1]
    for c in clocks:  # one machine, one clock: the estimate is off by its bound at most
        assert abs(c["offset_s"]) < c["round_trip_s"] + 0.005, c

    agent = report["agent"]
    assert agent["ratio"] > 0 and agent["plain_step_s"] > 0 and agent["agent_step_s"] > 0
    assert agent["ratio"] == pytest.approx(agent["agent_step_s"] / agent["plain_step_s"])

    # Rank 0 printed the one table, with every section.
    out = proc.stdout
    assert out.count("zerowatch selftest selftest-") == 1
    for section in ("world", "engine", "collectives", "agent", "clocks"):
        assert f"  {section} " in out, out
    assert "ZeRO-3" in out and "busbw" in out and "PASS" in out


def _trained(stage: int) -> dict[str, torch.Tensor]:
    """The engine's weights at `stage` on one rank in this process (no torch.distributed)."""
    return selftest.engine_state(stage, steps=2, rank=0, world_size=1)


def test_the_engine_check_fails_on_weights_off_by_more_than_the_tolerance() -> None:
    want = selftest.reference_state(steps=2, world_size=1, device=torch.device("cpu"))
    got = _trained(stage=1)
    assert selftest.stage_verdict(1, got, want)["pass"] is True

    off = {k: v.clone() for k, v in got.items()}
    off["blocks.1.fc.weight"] *= 1 + 1e-3  # a thousandth: ten times the tolerance
    verdict = selftest.stage_verdict(1, off, want)
    assert verdict["pass"] is False
    assert verdict["worst_tensor"] == "blocks.1.fc.weight"
    assert verdict["max_rel_error"] == pytest.approx(1e-3, rel=0.01)

    broken = dict(got, **{"ln_f.weight": torch.full_like(got["ln_f.weight"], float("nan"))})
    assert selftest.stage_verdict(1, broken, want) == {
        "stage": 1, "max_rel_error": None, "worst_tensor": "ln_f.weight", "pass": False
    }  # fmt: skip
    missing = {k: v for k, v in got.items() if k != "pos_emb.weight"}
    assert selftest.stage_verdict(1, missing, want)["pass"] is False


def _report(*, passed: bool) -> dict[str, Any]:
    """A report as rank 0 holds it, of 2 ranks, one stage, one collective."""
    stage = {"stage": 2, "max_rel_error": 2e-7 if passed else 3e-2, "worst_tensor": "ln_f.bias",
             "pass": passed}  # fmt: skip
    return {
        "name": "selftest-20260101-000000", "pass": passed,
        "world": {"world_size": 2, "backend": "gloo", "devices": {"CPU (x86_64)": 2}, "hosts": 1,
                  "rank_hosts": ["a", "a"], "torch": "2.13.0", "zerowatch": "0.1.0"},
        "engine": {"pass": passed, "tolerance": 1e-4, "steps": 3, "stages": [stage]},
        "collectives": [selftest.bandwidth_row("all_reduce", 2**20, 1e-3, 2)],
        "agent": {"stage": 2, "steps": 5, "model": "GPT", "plain_step_s": 0.02,
                  "agent_step_s": 0.021, "ratio": 1.05, "shipped_to": None, "run_id": "x"},
        "clocks": {"rounds": 8, "ranks": [
            {"rank": 0, "host": "a", "offset_s": 0.0, "round_trip_s": 0.0},
            {"rank": 1, "host": "a", "offset_s": 1e-5, "round_trip_s": 4e-4}]},
    }  # fmt: skip


def test_a_failed_engine_check_or_an_unreachable_server_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = selftest.Options(json_path=str(tmp_path / "r.json"))
    assert selftest.finish(_report(passed=True), opts) == 0
    assert selftest.finish(_report(passed=False), opts) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "ZeRO-2" in out and "3.00e-02" in out
    assert json.loads((tmp_path / "r.json").read_text())["pass"] is False

    nowhere = selftest.Options(server="http://127.0.0.1:9")  # nothing listens on port 9
    report = _report(passed=True)
    assert selftest.finish(report, nowhere) == 1
    assert "error" in report["server"]
    assert "not sent to http://127.0.0.1:9" in capsys.readouterr().out


def test_a_clock_round_bounds_the_offset_by_half_its_round_trip() -> None:
    # Rank r's clock runs 40 ms ahead; the messages take 1 ms and 3 ms one way.
    offset, rtt = selftest.clock_estimate(t0=100.0, t1=100.0 + 0.001 + 0.040,
                                          t2=100.0 + 0.002 + 0.040, t3=100.0 + 0.005)  # fmt: skip
    assert rtt == pytest.approx(0.004)
    assert offset == pytest.approx(0.039)
    assert abs(offset - 0.040) <= rtt / 2


def test_bad_options_are_refused_naming_the_option() -> None:
    with pytest.raises(selftest.UsageError, match="--stages"):
        selftest.parse_args(["--stages", "0,5"])
    with pytest.raises(selftest.UsageError, match="--sizes"):
        selftest.parse_args(["--sizes", "lots"])
    proc = subprocess.run([sys.executable, "-m", "zerowatch.cli", "selftest", "--iters", "0"],
                          capture_output=True, text=True, timeout=60, env=_env())  # fmt: skip
    assert proc.returncode == 2
    assert "--iters" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_cli_sends_the_report_to_a_server_that_gives_it_back(tmp_path: Path) -> None:
    with LiveServer() as server:
        proc = _run([sys.executable, "-m", "zerowatch.cli", "selftest", "--nproc-per-node", "2",
                     "--server", server.url, "--json", "out.json", "--stages", "2",
                     *FAST[2:]], tmp_path)  # fmt: skip
        report = json.loads((tmp_path / "out.json").read_text())
        run_id = report["server"]["run_id"]
        assert f"{server.url}/runs/{run_id}" in proc.stdout

        runs = httpx.get(f"{server.api}/runs", params={"project": "selftest"}, timeout=10)
        by_id = {r["run_id"]: r for r in runs.json()["runs"]}
        assert set(by_id) == {run_id, report["agent"]["run_id"]}

        stored: dict[str, Any] = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        assert stored["status"] == "finished"
        assert stored["engine_info"]["selftest"]["engine"] == report["engine"]
        assert stored["engine_info"]["selftest"]["collectives"] == report["collectives"]
        assert "engine:pass" in stored["tags"] and "world:2" in stored["tags"]
        tagged = httpx.get(f"{server.api}/runs", params={"tag": "engine:pass"}, timeout=10)
        assert [r["run_id"] for r in tagged.json()["runs"]] == [run_id]

        # The agent check's steps were shipped as a run of their own, from both ranks.
        agent = httpx.get(f"{server.api}/runs/{report['agent']['run_id']}", timeout=10).json()
        assert agent["zero_stage"] == 2 and agent["status"] == "finished"
        assert sorted(r["rank"] for r in agent["ranks"]) == [0, 1]
        assert all(r["steps"] >= 5 for r in agent["ranks"]), agent["ranks"]
