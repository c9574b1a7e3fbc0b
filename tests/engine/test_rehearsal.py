"""Stage 3's parameter management, timed by the engine at initialization on the job's own
parameters (engine/rehearsal.py) for the doctor to price from a run below stage 3."""

from __future__ import annotations

import torch
from support.engine_scenarios import make_model

from zerowatch.config import ZeroConfig
from zerowatch.engine.rehearsal import stage3_management_s


def _params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    return [(n, p, 0) for n, p in model.named_parameters()]


def test_rehearsal_times_the_management_and_leaves_the_parameters_as_they_were() -> None:
    model = make_model()
    params = _params(model)
    before = [(p.data_ptr(), p.data.clone()) for _, p, _ in params]
    zc = ZeroConfig(stage=1, reduce_bucket_size=600, stage3_param_persistence_threshold=40)
    got = stage3_management_s(model, params, zc, world_size=2, gradient_accumulation_steps=2,
                              device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    assert got is not None and 0 < got < 1.0
    for (_, p, _), (ptr, values) in zip(params, before, strict=True):
        assert p.data_ptr() == ptr and torch.equal(p.data, values)  # the same storage
        assert p.grad is None


def test_rehearsal_is_not_timed_for_one_rank_a_gpu_nothing_sharded_or_stage_3() -> None:
    model = make_model()
    params = _params(model)
    zc = ZeroConfig(stage=1, reduce_bucket_size=600, stage3_param_persistence_threshold=40)
    whole = ZeroConfig(stage=1, stage3_param_persistence_threshold=10**9)
    at3 = ZeroConfig(stage=3, reduce_bucket_size=600, stage3_param_persistence_threshold=40)
    for z, n, device in ((zc, 1, "cpu"), (zc, 2, "cuda"), (whole, 2, "cpu"), (at3, 2, "cpu")):
        got = stage3_management_s(model, params, z, world_size=n, gradient_accumulation_steps=1,
                                  device=torch.device(device), dtype=torch.float32)  # fmt: skip
        assert got is None
