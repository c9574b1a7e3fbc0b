"""On a CUDA machine: one process trains on the GPU (offload buffers pinned) and matches
single-process AdamW. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from support.engine_scenarios import TINY, ds_config, make_model, max_relative_error, reference_run

import zerowatch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("stage", [2, 3])
def test_gpu_engine_with_offload_matches_adamw(stage: int) -> None:
    config = ds_config(stage, offload_optimizer=True, offload_param=stage == 3)
    engine, *_ = zerowatch.initialize(model=make_model(), config=config)
    assert engine.device.type == "cuda"
    assert all(m.param.is_pinned() for m in engine.masters.masters)
    from support.engine_scenarios import micro_batches

    for s in range(5):
        for x, y in micro_batches(TINY, s, 1, 1, 0):
            engine.backward(engine(x, y))
            engine.step()
    want = reference_run(1, 1, steps=5).state_dict
    err, key = max_relative_error(engine.consolidated_state_dict(), want)
    assert err < 1e-4, key  # TF32/cuBLAS reductions differ slightly from the CPU reference
    torch.cuda.synchronize()
