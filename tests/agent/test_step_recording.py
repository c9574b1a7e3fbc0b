"""What the agent records per step, on a fake single-process engine (fast; the multi-rank
tests check the same against the real engine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from zerowatch.agent import recorder
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch import events as ev


def spooled(run: zerowatch.agent.Run) -> list[dict]:
    """Every event this rank's agent spooled (no server), in order."""
    out = []
    for seg in segments(run.spool_path / f"rank-{run.rank:05d}"):
        out.extend(obj for _, obj in read_events(seg))
    return out


def test_each_step_becomes_one_event_with_phases_collectives_and_memory(fake_engine, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, spans_every=2) as run:
        for _ in range(4):
            fake_engine.train_step()
            run.log(loss=2.0, tokens=512)
    assert isinstance(run, zerowatch.agent.Run) and run.status == "finished"
    events = spooled(run)
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [0, 1, 2, 3]
    assert [e["seq"] for e in events] == list(range(5))
    assert events[-1]["kind"] == "end" and events[-1]["status"] == "finished"
    for e in steps:
        phases = e["phases"]
        top = phases["forward"] + phases["backward"] + phases["optimizer_step"]
        assert top + phases["other"] == pytest.approx(e["step_time_s"], rel=1e-9)
        assert phases["other"] < 0.2 * e["step_time_s"]  # only callbacks run between phases
        assert phases["backward_inner"] == pytest.approx(phases["backward"] - phases["grad_reduce"])
        by_op = {(c["op"], c["purpose"]): c for c in e["collectives"]}
        rs = by_op[("reduce_scatter", "grad_reduce")]
        assert (rs["count"], rs["bytes"], rs["async_count"], rs["world_size"]) == (2, 4000, 1, 2)
        assert sum(rs["buckets"]) == 2 and len(rs["buckets"]) == len(ev.LATENCY_BUCKETS) + 1
        assert rs["latency_max_s"] <= rs["latency_sum_s"]
        assert rs["algbw_bytes_per_s"] == pytest.approx(4000 / rs["latency_sum_s"])
        assert rs["busbw_bytes_per_s"] == pytest.approx(rs["algbw_bytes_per_s"] * 0.5)
        # Only the synchronous reduce-scatter and all-gather were exposed: their latencies,
        # not the asynchronous reduce-scatter's.
        total = rs["latency_sum_s"] + by_op[("all_gather", "optimizer_gather")]["latency_sum_s"]
        assert e["exposed_comm_s"] == pytest.approx(fake_engine.exposed_by_step[e["step"]])
        assert 0 < e["exposed_comm_s"] < total
        assert e["offload"] == [{"direction": "d2h", "bytes": 4000, "seconds": pytest.approx(0.001),
                                 "bandwidth_bytes_per_s": pytest.approx(4e6)}]  # fmt: skip
        mem = e["memory"]
        assert mem["model_state"] == fake_engine.model_state_bytes()
        assert mem["model_state_theory"] == fake_engine.theory().flat()
        assert set(mem["peak_by_phase"]) == {"forward", "backward", "optimizer_step"}
        assert mem["rss_peak_bytes"] >= max(mem["peak_by_phase"].values()) > 0
        assert e["grad_norm"] == 1.5 and e["lr"] == 1e-3 and not e["nonfinite"]
        assert e["loss"] == 2.0 and e["tokens"] == 512 and e["samples"] == 4
        assert e["tokens_per_s"] == pytest.approx(512 / e["step_time_s"])
        assert e["samples_per_s"] == pytest.approx(4 / e["step_time_s"])
    # Spans every 2 steps: step, phases, collectives, offload.
    assert [e["spans"] is not None for e in steps] == [True, False, True, False]
    cats = {(s["cat"], s["name"]) for s in steps[0]["spans"]}
    assert {("phase", "step"), ("phase", "forward"), ("collective", "reduce_scatter"),
            ("collective", "all_gather"), ("offload", "offload_d2h")} <= cats  # fmt: skip
    step_span = next(s for s in steps[0]["spans"] if s["name"] == "step")
    assert step_span["end"] == pytest.approx(steps[0]["time"], abs=1e-3)


def test_log_during_a_step_and_after_it_land_on_that_step(fake_engine, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        run.log(tokens=100)  # before the first step starts: goes to step 0
        fake_engine.train_step()
        run.log(loss=1.0, tokens=100, lr_custom=0.5)  # after step 0 ended: still step 0
        run.log(loss=3.0)
        fake_engine.train_step()
    steps = [e for e in spooled(run) if e["kind"] == "step"]
    assert steps[0]["tokens"] == 200 and steps[0]["loss"] == 2.0
    assert steps[0]["scalars"] == {"lr_custom": 0.5}
    assert steps[1]["tokens"] == 0 and steps[1]["loss"] is None and steps[1]["tokens_per_s"] is None


def test_logged_lr_and_grad_norm_become_the_steps_own(fake_engine, spool_root):
    """What a training framework logs (the Trainer callbacks) wins over the optimizer's view;
    a step without them keeps the engine's."""
    fake_engine.last_step.lr, fake_engine.last_step.grad_norm = 1e-3, 1.5
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        fake_engine.train_step()
        run.log(lr=2.5e-4, grad_norm=0.75)
        fake_engine.train_step()
    s0, s1 = (e for e in spooled(run) if e["kind"] == "step")
    assert (s0["lr"], s0["grad_norm"], s0["scalars"]) == (2.5e-4, 0.75, {})
    assert (s1["lr"], s1["grad_norm"]) == (1e-3, 1.5)


def test_nonfinite_loss_and_grad_norm_are_flagged_not_sent(fake_engine, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        fake_engine.train_step()
        run.log(loss=float("nan"), tokens=float("inf"), other=float("nan"))
        fake_engine.last_step.grad_norm = float("inf")
        fake_engine.train_step()
        fake_engine.last_step.grad_norm = 2.0
        fake_engine.train_step()
        run.log(loss=1.0)
    s0, s1, s2 = (e for e in spooled(run) if e["kind"] == "step")
    assert s0["nonfinite"] and s0["loss"] is None and s0["grad_norm"] is None
    assert s0["tokens"] == 0 and s0["scalars"] == {}
    assert s1["nonfinite"] and s1["grad_norm"] is None
    assert not s2["nonfinite"] and s2["grad_norm"] == 2.0 and s2["loss"] == 1.0


def test_mfu_uses_6n_plus_attention_flops_per_token(fake_engine, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, peak_flops=1e9,
                              num_layers=2, hidden_size=8, seq_len=16) as run:  # fmt: skip
        fake_engine.train_step()
        run.log(tokens=1000)
    (s0,) = (e for e in spooled(run) if e["kind"] == "step")
    per_token = 6 * 1000 + 12 * 2 * 8 * 16
    assert s0["mfu"] == pytest.approx(1000 / s0["step_time_s"] * per_token / 1e9)


def test_bad_log_values_and_unknown_options_name_the_key(fake_engine, spool_root):
    with pytest.raises(TypeError, match="spans_every"):
        zerowatch.instrument(fake_engine, spool_dir=spool_root, span_every=3)
    with pytest.raises(ValueError, match="queue_size"):
        zerowatch.instrument(fake_engine, spool_dir=spool_root, queue_size=0)
    with pytest.raises(ValueError, match="server"):
        zerowatch.instrument(fake_engine, server="localhost:8321", spool_dir=spool_root)
    with pytest.raises(TypeError, match="engine"):
        zerowatch.instrument(object(), spool_dir=spool_root)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        with pytest.raises(TypeError, match="loss"):
            run.log(loss="low")
        with pytest.raises(TypeError, match="flag"):
            run.log(flag=True)
        fake_engine.train_step()


def test_a_failing_block_crashes_the_run_with_the_exception_and_detaches(fake_engine,
                                                                          spool_root):  # fmt: skip
    with (
        pytest.raises(RuntimeError) as raised,
        zerowatch.instrument(fake_engine, spool_dir=spool_root) as run,
    ):
        fake_engine.train_step()
        error = RuntimeError("diverged")
        raise error
    assert raised.value is error  # the user's code sees the same exception
    end = spooled(run)[-1]
    assert end["kind"] == "end" and end["status"] == "crashed" and "diverged" in end["error"]
    crash = end["crash"]
    assert (crash["type"], crash["message"], crash["oom"]) == ("RuntimeError", "diverged", False)
    assert "raise error" in crash["stack"] and crash["memory"] is None
    assert not fake_engine.registry
    run.close()  # idempotent


def test_keyboard_interrupt_in_the_block_marks_the_run_failed(fake_engine, spool_root):
    with (
        pytest.raises(KeyboardInterrupt),
        zerowatch.instrument(fake_engine, spool_dir=spool_root) as run,
    ):
        fake_engine.train_step()
        raise KeyboardInterrupt
    end = spooled(run)[-1]
    assert end["status"] == "failed" and end["crash"] is None


def test_agent_errors_are_counted_never_raised(fake_engine, spool_root, monkeypatch):
    run = zerowatch.instrument(fake_engine, spool_dir=spool_root)

    def broken() -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr(fake_engine, "model_state_bytes", broken)
    fake_engine.train_step()  # does not raise
    fake_engine.train_step()
    run.close()
    events = spooled(run)
    assert [e["kind"] for e in events] == ["step", "step", "end"]
    assert events[-1]["agent_errors"] == 2 and events[-1]["dropped_events"] == 0
    assert fake_engine.registry.errors == 0  # the agent swallowed them itself


def test_importing_the_agent_does_not_import_torch():
    code = "import zerowatch, zerowatch.agent, zerowatch.agent.upload, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_create_is_spooled_with_the_job_description(fake_engine, spool_root):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, run="My Exp!", project="p",
                              tags=["a", "b"]) as run:  # fmt: skip
        fake_engine.train_step()
    rc = json.loads((run.spool_path / "run.json").read_text())
    assert rc["run_id"] == run.id and run.id.startswith("my-exp-")
    assert (rc["name"], rc["project"], rc["tags"]) == ("My Exp!", "p", ["a", "b"])
    assert rc["world_size"] == 2 and rc["zero_stage"] == 2 and rc["param_count"] == 1000
    assert rc["theory"] == fake_engine.theory().flat()
    assert rc["theory_comm"] == {"reduce_scatter": 4000, "all_gather": 4000}
    # No host list: each rank's events name its own host and node.
    assert rc["hosts"] == [] and rc["torch_version"] and rc["zerowatch_version"]
    assert math.isclose(rc["started_at"], run._transport.spool.run_dir.stat().st_mtime, abs_tol=60)
    assert Path(run.spool_path).parent == spool_root


def test_steps_are_numbered_from_the_engines_step_count(fake_engine, spool_root):
    for _ in range(3):
        fake_engine.train_step()
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        fake_engine.train_step()
        fake_engine.train_step()
    assert [e["step"] for e in spooled(run) if e["kind"] == "step"] == [3, 4]


def test_rank_0_says_where_to_watch_the_run(fake_engine, spool_root, capsys, monkeypatch):
    monkeypatch.delenv("ZEROWATCH_SERVER", raising=False)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        pass
    err = capsys.readouterr().err
    assert f"zerowatch: run {run.id}: no server: spooling to " in err
    assert "zerowatch upload" in err
    # With a server (none listening: the shipper spools, the line is printed regardless).
    with zerowatch.instrument(
        fake_engine, server="http://127.0.0.1:9/", spool_dir=spool_root, http_timeout_s=0.2
    ) as run:
        pass
    assert f"zerowatch: run {run.id}: http://127.0.0.1:9/runs/{run.id}" in (capsys.readouterr().err)


def _burn(seconds: float) -> None:
    """Spend `seconds` of CPU on the calling thread."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_a_host_run_carries_the_cpu_time_of_its_training_thread_and_of_the_others(
    fake_engine, spool_root, monkeypatch
):
    # Every forward spends 20 ms of CPU on the training thread while another thread (a
    # communication thread's part) spends 30 ms; the optimizer step only sleeps.
    def phase(name: str, seconds: float) -> None:
        fake_engine.registry.call("on_phase_start", name, time.perf_counter())
        other = threading.Thread(target=_burn, args=(0.03,))
        other.start()
        _burn(0.02)
        other.join()
        fake_engine.registry.call("on_phase_end", name, time.perf_counter())

    monkeypatch.setattr(fake_engine, "_phase", phase)
    monkeypatch.setattr(recorder, "_compute_in_one_thread", lambda: True)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        for _ in range(3):
            fake_engine.train_step()
    steps = [e for e in spooled(run) if e["kind"] == "step"]
    for e in steps:
        assert 0.02 <= e["thread_cpu_s"] < 0.02 + 0.5 * (e["step_time_s"] - 0.02)
        assert 0.03 <= e["other_cpu_s"] < 0.045
    # With torch's intra-op pool computing beside the training thread, the other threads'
    # CPU time is not communication's: nothing is measured.
    monkeypatch.setattr(recorder, "_compute_in_one_thread", lambda: False)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        fake_engine.train_step()
    (e,) = [e for e in spooled(run) if e["kind"] == "step"]
    assert e["thread_cpu_s"] is None and e["other_cpu_s"] is None


def test_cpu_times_are_measured_only_with_one_intra_op_thread(monkeypatch) -> None:
    class Torch:
        threads = 4

        def get_num_threads(self) -> int:
            return self.threads

    fake = Torch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert not recorder._compute_in_one_thread()
    fake.threads = 1
    assert recorder._compute_in_one_thread()


def test_events_of_an_agent_without_cpu_times_still_read_as_none() -> None:
    old = {"rank": 0, "seq": 0, "step": 0, "time": 1.0, "step_time_s": 0.1}
    e = ev.StepEvent(**old)  # type: ignore[arg-type]
    assert e.thread_cpu_s is None and e.other_cpu_s is None
