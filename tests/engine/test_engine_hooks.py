"""The engine's hooks on the model come off when they should: `engine.destroy()`, an engine
that is discarded, a model wrapped again. After that the model runs none of the old
engine's reductions or gathers."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from support.engine_scenarios import TINY, ds_config, make_model
from torch import nn

import zerowatch
from zerowatch.examples.gpt import random_batch


def _hooks(model: nn.Module) -> int:
    """Hooks on the model: gradient hooks on parameters, forward hooks on modules."""
    grads = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    forwards = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return grads + forwards


class Phases:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_phase_start(self, phase: str, t: float) -> None:
        self.seen.append(phase)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(TINY, 2, seed=0)  # type: ignore[no-any-return]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_destroy_takes_every_hook_off_the_model(stage: int) -> None:
    model = make_model()
    before = _hooks(model)
    engine, *_ = zerowatch.initialize(model=model, config=ds_config(stage))
    assert _hooks(model) > before
    engine.destroy()
    assert _hooks(model) == before
    engine.destroy()  # idempotent
    assert _hooks(model) == before


def test_a_destroyed_engine_reduces_no_gradient() -> None:
    model = make_model()
    engine, *_ = zerowatch.initialize(model=model, config=ds_config(2))
    seen = Phases()
    engine.add_observer(seen)
    x, y = _batch()
    engine.backward(engine(x, y))
    assert "grad_reduce" in seen.seen  # the stage-2 reducer takes each gradient as it arrives
    engine.destroy()
    seen.seen.clear()
    model.zero_grad()
    model(x, y).backward()
    assert seen.seen == []
    # The gradients stay where autograd put them (the reducer would have taken them).
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_discarded_engine_takes_its_hooks_with_it() -> None:
    model = make_model()
    before = _hooks(model)
    out: Any = zerowatch.initialize(model=model, config=ds_config(1))
    assert _hooks(model) > before
    del out
    gc.collect()
    assert _hooks(model) == before


def test_wrapping_a_model_again_unhooks_the_earlier_engine() -> None:
    model = make_model()
    first, *_ = zerowatch.initialize(model=model, config=ds_config(1))
    once = _hooks(model)
    second, *_ = zerowatch.initialize(model=model, config=ds_config(2))
    assert _hooks(model) == once  # the first engine's hooks are gone, the second's are on
    seen = Phases()
    first.add_observer(seen)
    x, y = _batch()
    second.backward(second(x, y))
    second.step()
    assert seen.seen == []  # the first engine took no part in the step
    assert first is not second


def test_a_model_partitioned_by_a_live_stage3_engine_is_not_wrapped_again() -> None:
    model = make_model()
    engine, *_ = zerowatch.initialize(model=model, config=ds_config(3))
    with pytest.raises(ValueError, match="model: its parameters are partitioned"):
        zerowatch.initialize(model=model, config=ds_config(1))
    assert engine.zero_stage == 3
