"""One clock for a job: each rank's offset to rank 0's clock is estimated over the job's
process group, and every time the agent sends is on rank 0's clock."""

from __future__ import annotations

import time

import pytest
from clock_jobs import skewed_clock_run
from support.engine_harness import run_ranks
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch import clocks

SKEW_S, STEPS = 0.250, 4


def test_a_skewed_clock_is_recovered_and_the_ranks_times_agree_after_correction(tmp_path):
    r0, r1 = run_ranks(skewed_clock_run, 2, str(tmp_path / "spool"), SKEW_S, 1, STEPS)
    assert r0["offset"] == 0.0
    assert r1["offset"] == pytest.approx(SKEW_S, abs=1e-3)
    # The ranks end each step together (its gradients' all-reduce): their stamps agree to
    # well under the skew once corrected.
    by_step = [{e["step"]: e for e in r["steps"]} for r in (r0, r1)]
    assert sorted(by_step[0]) == sorted(by_step[1]) == list(range(STEPS))
    for step in range(STEPS):
        a, b = by_step[0][step], by_step[1][step]
        assert abs(a["time"] - b["time"]) < 0.05, (step, a["time"] - b["time"])
        start_a = min(s["start"] for s in a["spans"])
        start_b = min(s["start"] for s in b["spans"])
        assert abs(start_a - start_b) < 0.05


def test_the_offset_is_the_midpoint_of_the_round_with_the_shortest_round_trip():
    # Rank 1's clock runs 40 ms ahead; each round's one-way delays (down, up): the second
    # round's are the shortest.
    rounds = [(0.004, 0.006), (0.001, 0.001), (0.010, 0.002)]
    reads: list[float] = []  # rank 0's clock: t0, its own t1 and t2, t3 of each round
    for i, (down, up) in enumerate(rounds):
        reads += [100.0 + i, 100.0 + i, 100.0 + i, 100.0 + i + down + up]
    clock = iter(reads)
    rank1 = iter([(100.0 + i + down + 0.040,) * 2 for i, (down, _) in enumerate(rounds)])
    table = clocks.measure(lambda obj, src=0: obj, lambda mine: [mine, next(rank1)], rank=0,
                           rounds=len(rounds), now=lambda: next(clock))  # fmt: skip
    assert table is not None and table[0] == (0.0, 0.0)
    offset, rtt = table[1]
    assert offset == pytest.approx(0.040) and rtt == pytest.approx(0.002)
    assert clocks.measure(lambda obj, src=0: obj, lambda mine: [0, mine], rank=1,
                          rounds=1) is None  # fmt: skip


def test_the_offset_is_estimated_again_between_steps_and_applied_to_what_follows(
    fake_engine, spool_root
):
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, clock_sync_every=2,
                              clock_sync_rounds=0) as run:  # fmt: skip
        estimates = iter([0.5, 1.0])
        run._recorder.resync_clock = lambda: next(estimates)
        ends = []
        for _ in range(5):
            fake_engine.train_step()
            ends.append(time.time())
    steps = [obj for seg in segments(run.spool_path / "rank-00000")
             for _, obj in read_events(seg) if obj["kind"] == "step"]  # fmt: skip
    # Steps 0-1 on the host's clock, 2-3 less 0.5 s, 4 less 1 s.
    shifts = [ends[e["step"]] - e["time"] for e in steps]
    for shift, want in zip(shifts, (0.0, 0.0, 0.5, 0.5, 1.0), strict=True):
        assert shift == pytest.approx(want, abs=0.05)
