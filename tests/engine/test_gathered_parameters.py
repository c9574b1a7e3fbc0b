"""`zerowatch.zero.GatheredParameters` (DeepSpeed's name): whole parameters on every rank
inside the block at every stage, and with `modifier_rank` the modifier's changes become the
training state on all ranks: training goes on as a plain model's does after the same change
(`param.fill_` between two AdamW steps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import (
    CLIP,
    LR,
    MICRO_BATCH,
    TINY,
    WEIGHT_DECAY,
    ds_config,
    make_model,
    max_relative_error,
    train_engine,
)

import zerowatch
from zerowatch.examples.gpt import random_batch

pytestmark = pytest.mark.slow

CASES = {
    "stage0": ds_config(0),
    "stage2": ds_config(2),
    "stage3": ds_config(3, persistence=10),
    "stage3-bf16-offload": ds_config(
        3, precision="bf16", offload_optimizer=True, offload_param=True, persistence=10
    ),
}
TARGET = "blocks.1.fc.weight"  # part of a sharded unit at stage 3
BEFORE, AFTER = 2, 3  # steps before and after the change


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config in CASES.items():
        model = make_model()
        engine, *_ = zerowatch.initialize(model=model, config=config)
        train_engine(engine, TINY, BEFORE, 1, world, rank)
        full = engine.consolidated_state_dict()
        params = dict(model.named_parameters())
        with zerowatch.zero.GatheredParameters(list(model.parameters())):
            whole = {k: p.detach().float().clone() for k, p in params.items()}
        numel_after = params[TARGET].numel()
        # Rank 0 re-initialises one weight; what the other rank writes must be dropped.
        with zerowatch.zero.GatheredParameters(params[TARGET], modifier_rank=0), torch.no_grad():
            params[TARGET].fill_(0.5 if rank == 0 else -7.0)
        changed = engine.consolidated_state_dict()
        train_engine(engine, TINY, AFTER, 1, world, rank, start=BEFORE)
        out[name] = {"full": full, "whole": whole, "numel_after": numel_after,
                     "changed": changed, "trained": engine.consolidated_state_dict()}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, 2, timeout_s=120)


def _plain_run_with_the_change(world: int = 2) -> dict[str, torch.Tensor]:
    """One process, the plain model, AdamW on the same global batches; the weight is set to
    0.5 between step BEFORE - 1 and step BEFORE."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for s in range(BEFORE + AFTER):
        if s == BEFORE:
            with torch.no_grad():
                dict(model.named_parameters())[TARGET].fill_(0.5)
        x, y = random_batch(TINY, MICRO_BATCH * world, seed=1000 + s)
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_are_whole_inside_the_block(case: str, results) -> None:
    full = results[0][case]["full"]  # rank 0's consolidated weights ({} on rank 1)
    for r in results:
        res = r[case]
        assert set(res["whole"]) <= set(full)
        dtype = torch.bfloat16 if "bf16" in case else torch.float32  # the compute dtype
        for k, got in res["whole"].items():  # the fp32 masters, in the compute dtype
            torch.testing.assert_close(got, full[k].to(dtype).float(), rtol=0, atol=0)
        if case.startswith("stage3"):  # released again after the block
            assert res["numel_after"] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_the_modifier_ranks_change_becomes_the_training_state(case: str, results) -> None:
    # Rank 0's consolidated weights join every rank's parts: the change, and nothing else,
    # reached every rank's parameter part and fp32 master.
    res = results[0][case]
    assert TARGET in res["changed"]
    for k, v in res["changed"].items():
        want = torch.full_like(v, 0.5) if k == TARGET else res["full"][k]
        assert torch.equal(v, want), k
    assert all(r[case]["changed"] == {} for r in results[1:])
    if case.endswith("bf16-offload"):
        return  # bf16 training is not compared with the fp32 reference
    err, key = max_relative_error(res["trained"], _plain_run_with_the_change())
    assert err < 1e-5, f"{case}: {key} differs by {err:.2e}"
