"""What each gloo rank runs in the crash and divergence tests (test_crash_and_divergence.py):
the real engine on a small GPT, instrumented against a live server, with a rank that runs
out of memory in a layer's forward, a NaN put into one rank's gradient of one layer, and a
NaN born in one rank's forward."""

from __future__ import annotations

from typing import Any

import torch
from rank_jobs import FAST, train
from support.engine_scenarios import ds_config, make_model

import zerowatch
from zerowatch.examples.gpt import GPTConfig

#: Four blocks: "the third layer" is blocks.2.
FOUR = GPTConfig(vocab_size=33, seq_len=8, d_model=16, n_layers=4, n_heads=2, tied=False)
OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
               "of 79.11 GiB of which 1.02 GiB is free.")  # fmt: skip


def oom_in_forward(rank: int, world: int, server: str, spool_root: str, oom_rank: int,
                   oom_step: int, layer: str) -> dict[str, Any]:  # fmt: skip
    """Train; rank `oom_rank` raises torch.OutOfMemoryError inside `layer`'s forward at step
    `oom_step` (the other rank stops before that step: stage 2's forward has no collective
    it could wait in). Returns whether the exception the loop saw is the one raised."""
    engine, *_ = zerowatch.initialize(model=make_model(FOUR), config=ds_config(2))
    raised: list[BaseException] = []
    at = {"step": -1}

    def blow_up(_m: Any, _i: Any, out: Any) -> Any:
        if at["step"] == oom_step:
            err = torch.OutOfMemoryError(OOM_MESSAGE)
            raised.append(err)
            raise err
        return out

    if rank == oom_rank:
        dict(engine.module.named_modules())[layer].register_forward_hook(blow_up)
    seen: BaseException | None = None
    try:
        with zerowatch.instrument(engine, server=server, run="oom", spool_dir=spool_root,
                                  **FAST) as run:  # fmt: skip
            for s in range(oom_step + 3):
                if rank != oom_rank and s == oom_step:
                    break
                at["step"] = s
                train(engine, run, s, rank, world, FOUR)
    except torch.OutOfMemoryError as e:
        seen = e
    return {"run_id": run.id, "status": run.status, "raised": bool(raised),
            "same": bool(raised) and seen is raised[0], "stats": run.stats}  # fmt: skip


def nan_in_gradient(rank: int, world: int, server: str, spool_root: str, nan_rank: int,
                    nan_step: int, param: str, steps: int) -> dict[str, Any]:  # fmt: skip
    """Train `steps` steps; on rank `nan_rank` a hook on `param` turns its gradient into NaN
    at step `nan_step`. Each rank logs its batch's ids."""
    engine, *_ = zerowatch.initialize(model=make_model(FOUR), config=ds_config(2))
    at = {"step": -1}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if at["step"] == nan_step else grad

    if rank == nan_rank:
        dict(engine.module.named_parameters())[param].register_hook(poison)
    with zerowatch.instrument(engine, server=server, run="nan-grad", spool_dir=spool_root,
                              **FAST) as run:  # fmt: skip
        for s in range(steps):
            at["step"] = s
            train(engine, run, s, rank, world, FOUR)
            run.log(batch_ids=[f"r{rank}-s{s}-{i}" for i in range(2)])
    return {"run_id": run.id}


def nan_in_forward(rank: int, world: int, server: str, spool_root: str, nan_rank: int,
                   nan_steps: list[int], layer: str, steps: int) -> dict[str, Any]:  # fmt: skip
    """Train `steps` steps in fp16 (the loss scaler skips a non-finite step, so the weights
    stay finite); on rank `nan_rank`, `layer`'s forward output is NaN at `nan_steps`."""
    engine, *_ = zerowatch.initialize(model=make_model(FOUR),
                                      config=ds_config(2, precision="fp16"))  # fmt: skip
    at = {"step": -1}

    def spoil(_m: Any, _i: Any, out: torch.Tensor) -> torch.Tensor:
        return out * float("nan") if at["step"] in nan_steps else out

    if rank == nan_rank:
        dict(engine.module.named_modules())[layer].register_forward_hook(spoil)
    with zerowatch.instrument(engine, server=server, run="nan-forward", spool_dir=spool_root,
                              **FAST) as run:  # fmt: skip
        for s in range(steps):
            at["step"] = s
            train(engine, run, s, rank, world, FOUR)
    return {"run_id": run.id}
