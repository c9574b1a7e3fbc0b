"""Stage 3's units: a submodule whose subtree fits the reduce bucket is gathered and reduced
as one (a block), anything larger is split down to the parameters each module holds; the
model itself and containers that never run are never units. Their buffers are reused
within a pass, never while a saved view still reads one."""

from __future__ import annotations

import torch
from support.engine_scenarios import TINY, make_model
from torch import nn

from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.stages import stage3_units
from zerowatch.examples.gpt import Block


def _units(model: nn.Module, bucket: int) -> list[tuple[type, int, list[str]]]:
    big = {id(p): (name, p, 0) for name, p in model.named_parameters() if p.numel() >= 40}
    segments, roots = stage3_units(model, big, 2, 0, max_numel=bucket)
    assert not big  # every sharded parameter is in a unit
    return [(type(r), s.numel, [slot.name for slot in s.slots])
            for s, r in zip(segments, roots, strict=True)]  # fmt: skip


def test_a_block_that_fits_the_bucket_is_one_unit() -> None:
    units = _units(make_model(TINY), bucket=3200)
    blocks = [u for u in units if u[0] is Block]
    assert len(blocks) == TINY.n_layers
    # Its four linear layers' sharded parameters (the fc bias too: it is over the threshold).
    assert all(len(names) == 5 for _, _, names in blocks)
    assert [u[0] for u in units if u[0] is not Block] == [nn.Embedding, nn.Embedding, nn.Linear]


def test_a_bucket_smaller_than_a_block_keeps_a_unit_per_module() -> None:
    units = _units(make_model(TINY), bucket=600)
    assert Block not in {u[0] for u in units}
    for _, _, names in units:  # the parameters of one module each
        assert len({name.rsplit(".", 1)[0] for name in names}) == 1


def test_the_model_and_module_lists_are_never_units() -> None:
    model = make_model(TINY)
    # A bucket holding everything: still no unit for the model or its ModuleList of blocks,
    # and no unit holds more than half of the sharded parameters.
    units = _units(model, bucket=10**9)
    total = sum(n for _, n, _ in units)
    assert {u[0] for u in units} <= {Block, nn.Embedding, nn.Linear}
    assert all(2 * n <= total for _, n, _ in units)


def test_the_pool_reuses_a_buffer_unless_a_view_of_it_lives() -> None:
    pool = BufferPool(torch.device("cpu"), torch.float32)
    a = pool.take(64)
    pool.give(a)
    assert pool.take(64) is a  # handed out again, no new allocation
    saved = a.view(8, 8).t()  # what autograd keeps of `x @ w.T`
    pool.give(a)
    assert pool.held_numel() == 0 and pool.take(64) is not a
    del saved
    pool.give(a)
    assert pool.held_numel() == 64
    pool.clear()
    assert pool.held_numel() == 0
