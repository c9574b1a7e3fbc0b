"""What each gloo rank runs in the checkpoint-and-restart test (test_checkpoint_restart.py):
the real engine on the tiny GPT, instrumented as one job, saving a checkpoint, killed
after it, and a second launch that loads the checkpoint and trains on."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from rank_jobs import FAST, train
from support.engine_scenarios import ds_config, make_model

import zerowatch


def killed_after_checkpoint(rank: int, world: int, server: str, spool_root: str, job: str,
                            ckpt: str, save_at: int, killed_at: int) -> None:  # fmt: skip
    """Train, save a checkpoint after `save_at` steps, train on to step `killed_at`, then
    die as a killed job does (SIGKILL: no end event, no flush), once the steps are sent."""
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2))
    run = zerowatch.instrument(engine, server=server, run="restart", job=job,
                               spool_dir=spool_root, **FAST)  # fmt: skip
    for s in range(killed_at):
        if s == save_at:
            engine.save_checkpoint(ckpt)
        train(engine, run, s, rank, world)
    deadline = time.monotonic() + 30
    while run.stats["sent"] < killed_at and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def restarted_from_checkpoint(rank: int, world: int, server: str, spool_root: str, job: str,
                              ckpt: str, steps: int) -> dict[str, Any]:  # fmt: skip
    """The second launch: load the newest checkpoint, train to `steps`."""
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2))
    with zerowatch.instrument(engine, server=server, run="restart", job=job,
                              spool_dir=spool_root, **FAST) as run:  # fmt: skip
        engine.load_checkpoint(ckpt)
        for s in range(engine.global_steps, steps):
            train(engine, run, s, rank, world)
    return {"run_id": run.id, "resumed_at": steps}
