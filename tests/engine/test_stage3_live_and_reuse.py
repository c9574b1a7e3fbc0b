"""Stage 3's `stage3_max_live_parameters` and `stage3_max_reuse_distance`: prefetch never
holds more gathered elements than the live bound allows, and a block called twice in one
forward (or a weight tied to the LM head) is gathered once when its second use is within
the reuse distance, so the forward moves theory's Ψ; the training result is the same
either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import TIED, TINY, TwiceGPT, ds_config, make_model, train_engine

import zerowatch
from zerowatch import theory

pytestmark = pytest.mark.slow

STEPS = 3  # the first step records the order of use; the next ones prefetch and reuse
LIVE = 1200  # elements: a little more than the largest unit of the tiny GPT (1,088)


class ForwardGatherBytes:
    """Bytes all-gathered for parameters while the forward phase is open, per step."""

    def __init__(self) -> None:
        self.in_forward = False
        self.per_step: list[int] = []

    def on_phase_start(self, phase: str, _t: float) -> None:
        if phase == "forward":
            self.in_forward = True
            self.per_step.append(0)

    def on_phase_end(self, phase: str, _t: float) -> None:
        if phase == "forward":
            self.in_forward = False

    def on_collective(self, record: Any) -> None:
        if self.in_forward and record.purpose == "param_fetch":
            self.per_step[-1] += record.nbytes


def _train(rank: int, world: int, build: Any, cfg: Any = TINY, **zero: Any) -> dict[str, Any]:
    config = ds_config(3, overlap=True, persistence=10, bucket=300)
    config["zero_optimization"].update(zero)
    engine, *_ = zerowatch.initialize(model=make_model(cfg, build), config=config)
    sharded = engine.parts.owners[0]
    held: list[int] = []  # elements gathered after each prefetch decision
    prefetch = sharded._prefetch

    def counted_prefetch(mode: str) -> None:
        prefetch(mode)
        held.append(sharded.gathered_numel)

    sharded._prefetch = counted_prefetch
    gathers = ForwardGatherBytes()
    engine.add_observer(gathers)
    train_engine(engine, TINY, STEPS, 1, world, rank)
    # The ZeRO paper's stage 3: the forward gathers every sharded parameter once (Ψ), the
    # backward once more; theory.py's all-gather figure is both.
    per_step = theory.comm_bytes_per_step(engine.num_parameters, world, 3,
                                          persistent_params=engine.num_persistent_parameters)  # fmt: skip
    return {
        "theory_forward_bytes": per_step["all_gather"] // 2,
        "forward_bytes": gathers.per_step[-1],
        "max_held": max(held),
        "largest_unit": max(u.seg.numel for u in sharded.units.values()),
        "state": engine.consolidated_state_dict(),
    }


def _cases(rank: int, world: int) -> dict[str, Any]:
    return {
        "plain": _train(rank, world, None),
        "twice": _train(rank, world, TwiceGPT),  # DeepSpeed's default distance, 1e9
        "twice_no_reuse": _train(rank, world, TwiceGPT, stage3_max_reuse_distance=0),
        # A tied LM head: the embedding's weight is needed again at the end of the forward.
        "tied": _train(rank, world, None, TIED),
        "tied_no_reuse": _train(rank, world, None, TIED, stage3_max_reuse_distance=0),
        "wide_prefetch": _train(rank, world, None, stage3_prefetch_bucket_size=10**9),
        "wide_prefetch_live_bound": _train(
            rank, world, None, stage3_prefetch_bucket_size=10**9, stage3_max_live_parameters=LIVE
        ),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_cases, 2, timeout_s=120)


def test_a_block_called_twice_is_gathered_once_within_the_reuse_distance(results) -> None:
    for r in results:
        # Without reuse the twice-called block is gathered twice per forward; with it, the
        # forward gathers what the plain model's does (every unit once).
        assert r["twice"]["forward_bytes"] == r["plain"]["forward_bytes"]
        assert r["twice_no_reuse"]["forward_bytes"] > r["plain"]["forward_bytes"]
    # Same weights either way: keeping a gathered copy changes no arithmetic (rank 0's
    # consolidated weights; the other ranks get none).
    a, b = results[0]["twice"]["state"], results[0]["twice_no_reuse"]["state"]
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_forward_gathers_what_theory_says_also_with_a_tied_head(results) -> None:
    for r in results:
        for case in ("plain", "twice", "tied"):
            assert r[case]["forward_bytes"] == r[case]["theory_forward_bytes"], case
        # Without reuse, the tied weight is gathered a second time for the head.
        assert r["tied_no_reuse"]["forward_bytes"] > r["tied"]["theory_forward_bytes"]


def test_prefetch_holds_at_most_the_live_bound(results) -> None:
    for r in results:
        bounded, wide = r["wide_prefetch_live_bound"], r["wide_prefetch"]
        assert bounded["largest_unit"] <= LIVE  # the bound admits any single unit
        assert bounded["max_held"] <= LIVE
        assert wide["max_held"] > LIVE  # without the bound, prefetch runs further ahead
    a, b = results[0]["wide_prefetch_live_bound"]["state"], results[0]["wide_prefetch"]["state"]
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
