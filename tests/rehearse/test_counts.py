"""The collective calls counted for each stage and bucket size from the engine's layout
(zerowatch/rehearse/counts.py, sent in the run's engine_info for the doctor) are the calls
a real 2-rank gloo run makes per step, as the agent measures them (its spooled step
events)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.engine_harness import run_ranks
from support.engine_scenarios import TIED, TINY, ds_config, make_model, train_engine

import zerowatch
from zerowatch.rehearse import collective_calls

pytestmark = pytest.mark.slow

#: (stage, reduce_bucket_size, gradient accumulation, model): every stage at a small and a
#: large bucket (at 5,000 elements stage 3 gathers whole blocks), and a tied model.
CASES = [(stage, bucket, 1, "tiny") for stage in range(4) for bucket in (100, 5000)]
CASES += [(3, 600, 2, "tied"), (2, 600, 2, "tiny")]
STEPS = 3


def _measured_calls(spool: Path) -> list[dict[str, int]]:
    """Calls per op of each step rank 0's agent spooled (summed over purposes)."""
    steps = []
    for segment in sorted(spool.glob("*/rank-00000/*.jsonl")):
        for line in segment.read_text().splitlines():
            event = json.loads(line)
            if isinstance(event.get("collectives"), list):
                calls: dict[str, int] = {}
                for c in event["collectives"]:
                    calls[c["op"]] = calls.get(c["op"], 0) + int(c["count"])
                steps.append(calls)
    return steps


def _run(rank: int, world: int, spool_root: str) -> list[dict[str, Any]]:
    os.environ.pop("ZEROWATCH_SERVER", None)
    out = []
    for i, (stage, bucket, ga, model) in enumerate(CASES):
        cfg = TIED if model == "tied" else TINY
        engine, *_ = zerowatch.initialize(
            model=make_model(cfg), config=ds_config(stage, bucket=bucket, ga=ga, overlap=stage >= 2)
        )
        with zerowatch.instrument(engine, run=f"calls-{i}", spool_dir=f"{spool_root}/{i}",
                                  rehearse=False):  # fmt: skip
            train_engine(engine, cfg, STEPS, ga, world, rank)
        table = collective_calls(engine)  # after training: from the live engine's layout
        assert table is not None
        at = table["bucket_sizes"].index(bucket)
        out.append({stage_key: {op: calls[at] for op, calls in per_op.items() if calls[at]}
                    for stage_key, per_op in table["calls"].items()})  # fmt: skip
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    spool = tmp_path_factory.mktemp("spool")
    return spool, run_ranks(_run, 2, str(spool), timeout_s=120)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"stage{s}-bucket{b}-ga{g}-{m}"
                                                          for s, b, g, m in CASES])  # fmt: skip
def test_counted_calls_are_the_calls_a_run_makes(
    case: int, counted: tuple[Path, list[Any]]
) -> None:
    spool, ranks = counted
    stage = CASES[case][0]
    want = ranks[0][case][str(stage)]
    assert ranks[1][case] == ranks[0][case]  # the same table on every rank
    steps = _measured_calls(spool / str(case))
    assert len(steps) >= STEPS - 1, steps
    for got in steps[1:]:  # (the first step also records stage 3's order: same calls)
        assert got == want, (CASES[case], got, want)


def test_counts_follow_the_bucket_size(counted: tuple[Path, list[Any]]) -> None:
    _, ranks = counted
    small, large = ranks[0][CASES.index((1, 100, 1, "tiny"))], ranks[0][CASES.index((1, 5000, 1,
                                                                                      "tiny"))]  # fmt: skip
    assert small["1"]["reduce_scatter"] > large["1"]["reduce_scatter"]
    assert small["3"]["all_gather"] > large["3"]["all_gather"]
