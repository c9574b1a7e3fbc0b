"""The DeepSpeed engine accessors a script may call after `import zerowatch as deepspeed`:
each answers what the engine did (one process, no torchrun)."""

from __future__ import annotations

import torch
from support.engine_scenarios import MICRO_BATCH, TINY, ds_config, make_model, micro_batches

import zerowatch


def test_deepspeed_accessors_answer_from_the_engine() -> None:
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2, ga=2))
    ga = engine.gradient_accumulation_steps
    assert ga == 2 and ga() == 2 and list(range(ga)) == [0, 1]  # an int DeepSpeed-style callable
    assert engine.train_micro_batch_size_per_gpu() == MICRO_BATCH
    assert engine.train_batch_size() == MICRO_BATCH * 2 * engine.world_size
    assert (engine.global_rank, engine.local_rank) == (0, 0)
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    for x, y in micro_batches(TINY, 0, 2, 1, 0):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    norm = engine.get_global_grad_norm()
    assert norm is not None and norm > 0 and norm == engine.last_step.grad_norm


def test_was_step_applied_is_false_after_an_fp16_overflow() -> None:
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2, precision="fp16"))
    (x, y), *_ = micro_batches(TINY, 0, 1, 1, 0)
    engine.backward(engine(x, y) * torch.tensor(float("inf")))
    engine.step()
    assert not engine.was_step_applied() and engine.get_global_grad_norm() is None
