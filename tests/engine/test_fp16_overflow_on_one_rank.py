"""An fp16 overflow that only one rank sees is skipped by every rank.

Under ZeRO each rank holds a shard of the reduced gradient, so an inf produced by one rank's
backward can end up in a single rank's shard. The overflow decision must be shared: if only
the rank holding the inf skipped the step and lowered its loss scale, the ranks' weights and
scales would part ways. Here rank 1 alone puts an inf into one gradient element, chosen to
land in the shard owned by rank 0 or by rank 1, and both ranks must skip that step, keep
the same loss scale and weights, and train normally on the next step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import TINY, ds_config, make_model, micro_batches

import zerowatch

#: The step at which rank 1 injects the inf (step 0 and step 2 are clean).
BAD_STEP = 1
CASES = [(stage, owner) for stage in (1, 2, 3) for owner in (0, 1)]


def _pick_element(engine: Any, owner: int) -> tuple[torch.nn.Parameter, int, int]:
    """A parameter and a flat index into it whose reduced gradient lands in `owner`'s shard
    of a sharded segment (not padding); also the segment's index."""
    for seg in engine.parts.segments:
        if not seg.sharded or seg.numel < seg.shards:
            continue
        # The middle of the owner's part, clamped to the real (unpadded) elements.
        pos = min(owner * seg.shard_numel + seg.shard_numel // 2, seg.numel - 1)
        if pos // seg.shard_numel != owner:
            continue
        for slot in seg.slots:
            if slot.offset <= pos < slot.offset + slot.numel:
                return slot.param, pos - slot.offset, seg.index
    raise AssertionError(f"no sharded segment has an element owned by rank {owner}")


def _one_rank_overflows(rank: int, world: int, stage: int, owner: int) -> dict[str, Any]:
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, *_ = zerowatch.initialize(model=make_model(),
                                      config=ds_config(stage, precision="fp16", fp16=fp16))  # fmt: skip
    param, index, seg_index = _pick_element(engine, owner)
    inject = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if not inject["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[index] = float("inf")
        return grad

    if rank == 1:
        param.register_hook(poison)
    seg = engine.parts.segments[seg_index]
    steps = []
    for s in range(3):
        before = engine.consolidated_state_dict()
        inject["on"] = s == BAD_STEP
        (x, y), = micro_batches(TINY, s, 1, world, rank)  # fmt: skip
        loss = engine(x, y)
        engine.backward(loss)
        # Which rank's reduced shard holds the inf (only meaningful at the bad step).
        shard_finite = bool(torch.isfinite(seg.grad_shard).all())
        scale_used = engine.scaler.scale
        engine.step()
        after = engine.consolidated_state_dict()
        # This rank's own compute-dtype copy of the weights it holds whole (stages 1-2: all
        # of them; stage 3: the persistent ones; released stage-3 parameters are empty).
        local = {n: p.detach().float().clone()
                 for n, p in engine.module.named_parameters() if p.numel()}  # fmt: skip
        adam_steps = sorted({float(st["step"]) for st in engine.optimizer.state.values()})
        steps.append({"before": before, "after": after, "stats": engine.last_step,
                      "scale_used": scale_used, "scale": engine.scaler.scale,
                      "scaler_state": engine.scaler.state_dict(), "shard_finite": shard_finite,
                      "skipped_steps": engine.skipped_steps, "adam_steps": adam_steps,
                      "loss": loss.item(), "local": local})  # fmt: skip
    # This rank's own fp32 master shards (differ between ranks; each must be finite).
    masters = [m.param.detach().clone() for m in engine.masters.masters]
    return {"steps": steps, "masters": masters}


def _all(rank: int, world: int) -> dict[tuple[int, int], Any]:
    return {case: _one_rank_overflows(rank, world, *case) for case in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[int, int], Any]]:
    return run_ranks(_all, 2, timeout_s=120)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "owner"), CASES, ids=[f"stage{s}-owner{o}" for s, o in CASES])
def test_overflow_on_one_rank_is_skipped_by_every_rank(
    stage: int, owner: int, results: list[dict[tuple[int, int], Any]]
) -> None:
    ranks = [results[r][(stage, owner)]["steps"] for r in (0, 1)]
    # The inf reached exactly one rank's reduced gradient shard: the owner's.
    for r in (0, 1):
        assert ranks[r][BAD_STEP]["shard_finite"] == (r != owner), (
            f"rank {r}: the injected inf is not where the case puts it"
        )
        for s, st in enumerate(ranks[r]):
            if s != BAD_STEP:
                assert st["shard_finite"], f"rank {r} step {s}: gradients should be finite"
    # The weights around each step: rank 0's consolidated ones (every rank's parts; rank 1
    # gets none), and each rank's whole copies after each step ("local").
    assert all(st["before"] == {} and st["after"] == {} for st in ranks[1])
    for r in (0, 1):
        clean0, bad, clean2 = ranks[r]
        assert not clean0["stats"].skipped
        # Every rank skips the overflowing step: weights and Adam state untouched.
        assert bad["stats"].skipped and bad["stats"].nonfinite, f"rank {r} stepped on an inf"
        assert bad["stats"].grad_norm is None
        assert _same(clean0["local"], bad["local"]), f"rank {r}: weights moved on a skipped step"
        assert bad["adam_steps"] == [1.0] and bad["skipped_steps"] == 1
        # hysteresis 1: the overflow halves the scale at once, on every rank.
        assert bad["scale_used"] == 2.0**8 and bad["scale"] == 2.0**7
        # The next step trains normally at the lowered scale.
        assert not clean2["stats"].skipped and clean2["stats"].grad_norm is not None
        assert clean2["scale_used"] == 2.0**7 and clean2["adam_steps"] == [2.0]
        assert not _same(bad["local"], clean2["local"])
        assert all(bool(torch.isfinite(m).all()) for m in results[r][(stage, owner)]["masters"])
    clean0, bad, clean2 = ranks[0]
    assert not _same(clean0["before"], clean0["after"])
    assert _same(bad["before"], bad["after"]), "weights moved on a skipped step"
    assert not _same(clean2["before"], clean2["after"])
    assert all(bool(torch.isfinite(v).all()) for v in clean2["after"].values())
    # Both ranks agree on everything, step by step.
    for s in range(3):
        a, b = ranks[0][s], ranks[1][s]
        assert a["stats"].skipped == b["stats"].skipped, f"step {s}: ranks disagree on skipping"
        assert a["scaler_state"] == b["scaler_state"], f"step {s}: loss scalers differ"
        assert a["local"] and _same(a["local"], b["local"]), f"step {s}: ranks' copies differ"
