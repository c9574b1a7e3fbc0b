"""fp16 gradients are divided by the world size before the sum across ranks, not after: a
static loss scale that keeps every rank's own gradients finite keeps their sum finite at
any world size. Summed first, N ranks' scaled gradients grow N-fold and overflow, and
every step is skipped (the scaler skips steps whose gradients are not finite)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import TINY, ds_config, make_model, micro_batches, reference_run

import zerowatch

WORLD = 4
FP16_MAX = 65504.0
STEPS = 5


def _static_scale() -> float:
    """A power of two that puts the largest gradient of the first step between a quarter
    and a half of fp16's range: one rank's scaled gradient fits (with room to grow over
    the steps), four ranks' sum does not."""
    model = make_model()
    x, y = next(micro_batches(TINY, 0, 1, 1, 0))
    model(x, y).backward()
    largest = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    return 2.0 ** (math.floor(math.log2(FP16_MAX / largest)) - 1)


def _configs(scale: float) -> dict[str, dict[str, Any]]:
    out = {}
    for stage in (0, 2, 3):
        out[f"stage{stage}"] = ds_config(stage, precision="fp16")
        out[f"stage{stage}"]["fp16"] = {"enabled": True, "loss_scale": scale}
    # DeepSpeed's gradient_predivide_factor: 1/2 before the sum, 2/N after (fp32).
    out["stage2-predivide2"] = ds_config(2, gradient_predivide_factor=2.0)
    return out


def _train(rank: int, world: int, scale: float) -> dict[str, Any]:
    out = {}
    for name, config in _configs(scale).items():
        engine, *_ = zerowatch.initialize(model=make_model(), config=config)
        losses = []
        for s in range(STEPS):
            # Every rank trains the same micro-batch: the sum across ranks is N times one
            # rank's gradient, the largest it can be.
            x, y = next(micro_batches(TINY, s, 1, 1, 0))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = {
            "skipped": engine.skipped_steps,
            "losses": losses,
            "predivide": engine.predivide,
        }
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_train, WORLD, _static_scale(), timeout_s=120)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["stage0", "stage2", "stage3"])
def test_fp16_near_its_static_scale_limit_trains_at_four_ranks(stage: str, results: Any) -> None:
    want = reference_run(1, 1, steps=STEPS).losses
    for rank, r in enumerate(results):
        assert r[stage]["skipped"] == 0, f"rank {rank}: {r[stage]['skipped']} steps skipped"
        worst = max(abs(a - b) for a, b in zip(r[stage]["losses"], want, strict=True))
        assert worst < 0.005, f"rank {rank}: the fp16 loss curve departs from fp32 by {worst:.4f}"


@pytest.mark.slow
def test_gradient_predivide_factor_is_honoured(results: Any) -> None:
    want = reference_run(1, 1, steps=STEPS).losses
    for r in results:
        case = r["stage2-predivide2"]
        assert case["predivide"] == 2.0
        assert max(abs(a - b) for a, b in zip(case["losses"], want, strict=True)) < 1e-5


def test_the_scale_would_overflow_a_sum_of_four() -> None:
    """The premise: four ranks' scaled gradients, summed in fp16, are not finite."""
    model = make_model()
    x, y = next(micro_batches(TINY, 0, 1, 1, 0))
    model(x, y).backward()
    scale = _static_scale()
    grads = [p.grad * scale for p in model.parameters() if p.grad is not None]
    assert all(bool(torch.isfinite(g.half()).all()) for g in grads)
    assert not all(bool(torch.isfinite(g.half() * WORLD).all()) for g in grads)
