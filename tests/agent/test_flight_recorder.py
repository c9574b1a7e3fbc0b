"""The flight recorder and the heartbeat, without torch: the ring keeps each group's newest
calls (a seq written over when the ring goes round), a call never completed stays
"launched", and a stalled rank's heartbeat carries its training thread's stack."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.heartbeat import HeartbeatSource, stack_of
from zerowatch.agent.probes.flight import FlightRecorder


def _done(group: str, seq: int, end: float = 2.0) -> SimpleNamespace:
    return SimpleNamespace(group=group, seq=seq, end=end)


def test_a_collective_launched_and_never_completed_is_the_newest_launch() -> None:
    fr = FlightRecorder(size=8)
    for seq in range(1, 21):
        fr.on_collective_launch("0", seq, "all_reduce", 100, "float32", 1.0)
        if seq < 20:
            fr.on_collective(_done("0", seq))
    fr.on_collective_launch("1", 1, "all_gather", 8, "bfloat16", 1.5)
    snap = fr.snapshot(1000.0, calls=4)
    assert (snap["0"]["launched"], snap["0"]["completed"]) == (20, 19)
    assert [c[0] for c in snap["0"]["calls"]] == [17, 18, 19, 20]
    assert snap["0"]["calls"][-1] == [20, "all_reduce", 100, "float32", "launched", 1001.0, None]
    assert snap["0"]["calls"][0][4:] == ["completed", 1001.0, None]
    assert snap["1"] == {"launched": 1, "completed": 0,
                         "calls": [[1, "all_gather", 8, "bfloat16", "launched", 1001.5, None]]}  # fmt: skip


def test_an_unnumbered_record_or_an_unknown_group_changes_nothing() -> None:
    fr = FlightRecorder(size=4)
    fr.on_collective(_done("", 0))
    fr.on_collective(_done("7", 3))
    assert fr.snapshot(0.0) == {}
    with pytest.raises(ValueError, match="size"):
        FlightRecorder(size=6)


def test_a_stalled_rank_sends_its_training_threads_stack() -> None:
    gate, started = threading.Event(), threading.Event()

    def blocked_loader() -> None:
        started.set()
        gate.wait()

    t = threading.Thread(target=blocked_loader, daemon=True)
    t.start()
    started.wait(5)
    fr = FlightRecorder()
    fr.on_collective_launch("0", 1, "all_reduce", 4, "float32", 0.0)
    rec = SimpleNamespace(flight=fr, step_times=[0.1, 0.1, 0.2], last_step=11,
                          last_step_end=time.perf_counter() - 3.0,
                          stalled_for=lambda now: 3.0, unix_of=lambda t: t + 100.0,
                          phase_now=lambda: "between_steps")  # fmt: skip
    cfg = AgentConfig(stall_floor_s=2.0, stall_factor=5.0)
    beat = HeartbeatSource(rec, cfg, rank=1, thread_id=t.ident).build()
    assert beat.stall_after_s == 2.0 and beat.stalled_s == 3.0 and beat.last_step == 11
    assert beat.phase == "between_steps" and beat.groups["0"].launched == 1
    assert beat.stack is not None
    assert "blocked_loader" in [f.function for f in beat.stack]
    # Not stalled yet: no stack.
    quick = HeartbeatSource(rec, AgentConfig(stall_floor_s=10.0), rank=1, thread_id=t.ident)
    assert quick.build().stack is None
    gate.set()
    t.join(5)
    assert stack_of(t.ident or 0) is None
