"""A checkpoint saved by 2 ranks, resumed by 1 and by 4 (the same global batch: accumulation
makes up for the ranks): the run continues as if uninterrupted (20 steps on 2 ranks), for
stages 1 (with a learning-rate schedule), 2 and 3 with both offloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import TINY, ds_config, make_model, max_relative_error, train_engine

import zerowatch
from zerowatch.examples.gpt import GPT

pytestmark = pytest.mark.slow

SAVED_WORLD, GLOBAL_MICRO_BATCHES = 2, 4  # micro-batches per step, over all ranks
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 1e-2}}
CASES = {
    "stage1-schedule": lambda ga: ds_config(1, ga=ga, scheduler=SCHEDULE),
    "stage2": lambda ga: ds_config(2, ga=ga, overlap=True),
    "stage3-offload-both": lambda ga: ds_config(
        3, ga=ga, offload_optimizer=True, offload_param=True, persistence=10
    ),
}


def _first_half(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save at step 10; and, as the reference, the same run trained 20 steps in one go."""
    ga = GLOBAL_MICRO_BATCHES // world
    whole = {}
    for name, config in CASES.items():
        engine, *_ = zerowatch.initialize(model=make_model(), config=config(ga))
        train_engine(engine, TINY, 10, ga, world, rank)
        engine.save_checkpoint(str(Path(root) / name))
        train_engine(engine, TINY, 10, ga, world, rank, start=10)
        whole[name] = engine.consolidated_state_dict()
    return whole


def _second_half(rank: int, world: int, root: str) -> dict[str, Any]:
    ga = GLOBAL_MICRO_BATCHES // world
    out = {}
    for name, config in CASES.items():
        torch.manual_seed(99)  # other initial weights: everything must come from the files
        engine, *_ = zerowatch.initialize(model=GPT(TINY), config=config(ga))
        engine.load_checkpoint(str(Path(root) / name))
        assert engine.global_steps == 10
        train_engine(engine, TINY, 10, ga, world, rank, start=10)
        out[name] = engine.consolidated_state_dict()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    root = str(tmp_path_factory.mktemp("reshard"))
    whole = run_ranks(_first_half, SAVED_WORLD, root, timeout_s=120)[0]
    return {"whole": whole, **{w: run_ranks(_second_half, w, root, timeout_s=120) for w in (1, 4)}}


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_resumes_on_another_number_of_ranks(case: str, world: int, runs) -> None:
    want = runs["whole"][case]
    # Rank 0's consolidated weights hold every rank's parts (the other ranks get none).
    first, *others = runs[world]
    err, key = max_relative_error(first[case], want)
    # Other ranks sum the same gradients in another order: equal up to rounding.
    assert err < 1e-5, f"{case} on {world} ranks: {key} differs by {err:.2e}"
    assert all(states[case] == {} for states in others)
