"""Ranks that leave different parameters without a gradient (a branch per rank, as MoE
routing or a conditional block does) issue the same collectives in the same order, with the
same sizes, and train to the weights of one process training the whole global batch.

Without that agreement NCCL hangs, or (as gloo showed) two equal-sized collectives of
different tensors pair up and sum the wrong buffers: wrong weights, no error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.branchy import LR, WEIGHT_DECAY, TwoBranch, make_model, rank_batch, reference
from support.engine_harness import run_ranks
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint

import zerowatch
from zerowatch.engine import comm as comm_module

STEPS = 5


def config(stage: int, *, overlap: bool, ga: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "zero_optimization": {
            "stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 600,
            "stage3_prefetch_bucket_size": 600, "stage3_param_persistence_threshold": 40,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    }  # fmt: skip


CASES = {
    f"stage{s}-overlap{int(o)}": config(s, overlap=o) for s in (0, 1, 2, 3) for o in (False, True)
}


def _train(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, cfg in CASES.items():
        engine, *_ = zerowatch.initialize(model=make_model(), config=cfg)
        for s in range(STEPS):
            engine.backward(engine(*rank_batch(s, rank)))
            engine.step()
        out[name] = engine.consolidated_state_dict()
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_ranks(_train, 2, timeout_s=60)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_training_its_own_branch_matches_adamw(name: str, two_ranks: Any) -> None:
    want = reference(2, STEPS)
    got = two_ranks[0][name]
    assert got, "rank 0 returned no consolidated weights"
    for key, w in want.items():
        err = float((got[key] - w).norm() / w.norm())
        assert err < 1e-5, f"{name}: {key} differs by {err:.2e} (relative)"


# -- one rank's view of a large job: torch's fake process group ----------------------------


class Sequence:
    """Every collective the engine hands to torch.distributed: (op, numel, dtype, group)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, torch.dtype, str]] = []
        for name, fn in (("_reduce_scatter", comm_module._reduce_scatter),
                         ("_all_gather", comm_module._all_gather)):  # fmt: skip
            monkeypatch.setattr(comm_module, name, self._wrap(name.strip("_"), fn, 1))
        monkeypatch.setattr(dist, "all_reduce", self._wrap("all_reduce", dist.all_reduce, 0))
        monkeypatch.setattr(dist, "broadcast", self._wrap("broadcast", dist.broadcast, 0))

    def _wrap(self, op: str, fn: Any, which: int) -> Any:
        def call(*args: Any, group: Any = None, **kw: Any) -> Any:
            t = args[which]
            name = (group or dist.group.WORLD).group_name
            self.calls.append((op, t.numel(), t.dtype, name))
            return fn(*args, group=group, **kw)

        return call


def _sequence(monkeypatch: pytest.MonkeyPatch, stage: int, rank: int, world: int,
              ga: int) -> list[tuple[str, int, torch.dtype, str]]:  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        engine, *_ = zerowatch.initialize(
            model=make_model(), config=config(stage, overlap=True, ga=ga)
        )
        with monkeypatch.context() as m:
            seq = Sequence(m)
            for s in range(2 * ga):
                engine.backward(engine(*rank_batch(s, rank)))
                engine.step()
        engine.destroy()
        return seq.calls
    finally:
        dist.destroy_process_group()


def _by_group(calls: list[tuple[str, int, torch.dtype, str]]) -> dict[str, list[Any]]:
    """Each process group's own sequence: NCCL orders the collectives of one group (one
    communicator), not how two groups' collectives interleave."""
    out: dict[str, list[Any]] = {}
    for op, numel, dtype, group in calls:
        out.setdefault(group, []).append((op, numel, dtype))
    return out


@pytest.mark.parametrize("world", [8, 64, 4096])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_rank_issues_the_same_collectives_whatever_its_unused_parameters(
    monkeypatch: pytest.MonkeyPatch, stage: int, world: int
) -> None:
    ga = 2 if world == 64 else 1
    first = _by_group(_sequence(monkeypatch, stage, 0, world, ga))
    assert first, "no collective recorded"
    for rank in (1, world - 1):  # the other branch; the last rank (padding lands there)
        seqs = _by_group(_sequence(monkeypatch, stage, rank, world, ga))
        assert seqs.keys() == first.keys()
        for group, seq in seqs.items():
            want = first[group]
            diverged = next(
                (i for i, (a, b) in enumerate(zip(want, seq, strict=False)) if a != b), None
            )
            assert diverged is None and len(seq) == len(want), (
                f"stage {stage}, world {world}, group {group}: rank {rank} issues "
                f"{seq[diverged or 0]} where rank 0 issues {want[diverged or 0]} (call "
                f"{diverged}; {len(seq)} vs {len(want)})"
            )


def test_stage3_gives_its_gradient_group_back_when_destroyed() -> None:
    """Stage 3's second process group (and, over gloo, its ring's thread) goes with the
    engine: a process that builds engine after engine does not collect communicators."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        engine, *_ = zerowatch.initialize(model=make_model(), config=config(3, overlap=True))
        grads = engine.grad_comm
        assert grads is not None and grads.group is not None
        assert grads.group in dist.distributed_c10d._world.pg_map
        engine.destroy()
        assert grads.group not in dist.distributed_c10d._world.pg_map
        assert engine.grad_comm is None
    finally:
        dist.destroy_process_group()


class CheckpointedBranch(TwoBranch):
    """Every rank's batch through the first branch, under torch's reentrant activation
    checkpoint: its parameters are out of the outer graph's sight (their backward runs
    inside the checkpoint's own)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, branch: int) -> torch.Tensor:
        del branch
        h = self.emb(idx)
        h = h + checkpoint(self.branches[0], h, use_reentrant=True)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))  # fmt: skip


def _checkpointed() -> CheckpointedBranch:
    torch.manual_seed(0)
    return CheckpointedBranch()


def _train_checkpointed(rank: int, world: int) -> dict[str, torch.Tensor]:
    engine, *_ = zerowatch.initialize(model=_checkpointed(), config=config(3, overlap=True))
    for s in range(STEPS):
        engine.backward(engine(*rank_batch(s, rank)))
        engine.step()
    return engine.consolidated_state_dict()


@pytest.mark.slow
def test_stage3_with_reentrant_checkpointing_matches_adamw() -> None:
    """The graph walk cannot see behind a reentrant checkpoint: it must say so (and the
    reducer wait for every gradient), not issue zeros for parameters that get one later."""
    got = run_ranks(_train_checkpointed, 2, timeout_s=60)[0]
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for s in range(STEPS):
        opt.zero_grad()
        (sum(model(*rank_batch(s, r)) for r in range(2)) / 2).backward()
        opt.step()
    for key, w in model.state_dict().items():
        if key.startswith("branches.1."):
            # No rank uses it: torch's AdamW skips a parameter without a gradient, the
            # engine (as DeepSpeed) steps it with a zero gradient (weight decay applies).
            continue
        err = float((got[key] - w).norm() / w.norm().clamp_min(1e-12))
        assert err < 1e-5, f"{key} differs by {err:.2e} (relative)"
