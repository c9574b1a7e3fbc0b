"""Each stage's communication path on the training thread (stage 3: its parameter management),
rehearsed on the job's process group with its parameters' layout (zerowatch/rehearse/paths.py)
for the doctor to price the stages a run does not run."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from support.engine_harness import run_ranks
from support.engine_scenarios import make_model

from zerowatch.config import ZeroConfig
from zerowatch.engine.comm import Comm
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.rehearse import paths
from zerowatch.rehearse.layout import Layout, of_params
from zerowatch.rehearse.paths import management_s

#: Rank 1 holds up every rehearsed pass this long (test_the_waits_are_left_out).
HOLD_S = 0.06


def _params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    return [(n, p, 0) for n, p in model.named_parameters()]


def _zc(stage: int = 1, **kw: Any) -> ZeroConfig:
    return ZeroConfig(stage=stage, reduce_bucket_size=600, stage3_param_persistence_threshold=40,
                      **kw)  # fmt: skip


def _layout(model: torch.nn.Module, zc: ZeroConfig, world: int, rank: int, ga: int = 1,
            device: str = "cpu") -> Layout:  # fmt: skip
    return of_params(model, _params(model), zc, world_size=world, rank=rank,
                     gradient_accumulation_steps=ga, device=torch.device(device),
                     dtype=torch.float32)  # fmt: skip


def _rehearse(rank: int, world: int, hold_rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_model()
    params = _params(model)
    before = [(p.data_ptr(), p.data.clone()) for _, p, _ in params]
    if rank == hold_rank:  # this rank is slow to start stage 3's micro-batch, every pass
        micro_batch = paths._Stage3._micro_batch

        def slow_micro_batch(self: Any) -> None:
            time.sleep(HOLD_S)
            micro_batch(self)

        paths._Stage3._micro_batch = slow_micro_batch  # type: ignore[method-assign]
    t0 = time.perf_counter()
    got = management_s(_layout(model, _zc(), world, rank, ga=2), Comm(ObserverRegistry()))
    took = time.perf_counter() - t0
    unchanged = all(p.data_ptr() == ptr and torch.equal(p.data, values) and p.grad is None
                    for (_, p, _), (ptr, values) in zip(params, before, strict=True))  # fmt: skip
    # The ranks' calls matched: a collective issued after the rehearsal still pairs up.
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    return {"got": got, "took": took, "unchanged": unchanged, "sum": float(probe.item())}


def test_rehearsal_communicates_in_step_and_leaves_the_parameters_alone() -> None:
    results = run_ranks(_rehearse, 2, None)
    for r in results:
        assert r["got"] is not None and set(r["got"]) == {0, 1, 2, 3}
        assert all(0 < v < 1.0 for v in r["got"].values())
        assert r["unchanged"]
        assert r["sum"] == 3.0


def test_the_waits_are_left_out_and_the_training_threads_own_time_counted() -> None:
    """Rank 1 sleeps at the start of stage 3's rehearsed micro-batch, every pass: rank 0
    waits that long in its first gather (a collective's wait, not its management), rank 1
    spends it outside any wait."""
    waiting, slow = run_ranks(_rehearse, 2, 1)
    passes = paths.PASSES + 1
    assert waiting["took"] >= passes * HOLD_S  # it did wait every pass ...
    assert waiting["got"][3] < HOLD_S / 2  # ... and that is not counted
    assert slow["got"][3] >= HOLD_S  # the training thread's own time is
    assert max(slow["got"][st] for st in (0, 1, 2)) < HOLD_S / 2  # the other stages' alone


def test_rehearsal_is_not_run_for_one_rank_or_a_gpu() -> None:
    """Nor does it rehearse stage 3 where no parameter would be sharded there."""
    model = make_model()
    for n, device in ((1, "cpu"), (2, "cuda")):
        got = management_s(_layout(model, _zc(), n, 0, device=device), Comm(ObserverRegistry()))
        assert got is None
    whole = ZeroConfig(stage=1, stage3_param_persistence_threshold=10**9)
    assert set(run_ranks(_whole, 2, whole)[0]) == {0, 1, 2}


def _whole(rank: int, world: int, zc: ZeroConfig) -> dict[int, float] | None:
    model = make_model()
    return management_s(_layout(model, zc, world, rank), Comm(ObserverRegistry()))


def _budget(rank: int, world: int) -> dict[str, Any]:
    paths.BUDGET_S = 0.0  # every rank: past the budget after the first measured round
    micro_batch, rounds = paths._Stage3._micro_batch, [0]

    def counted(self: Any) -> None:
        rounds[0] += 1
        micro_batch(self)

    paths._Stage3._micro_batch = counted  # type: ignore[method-assign]
    model = make_model()
    got = management_s(_layout(model, _zc(), world, rank), Comm(ObserverRegistry()))
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    return {"got": got, "rounds": rounds[0], "sum": float(probe.item())}


def test_past_its_budget_the_rehearsal_stops_on_every_rank_alike() -> None:
    """A large model's rounds take long: past BUDGET_S the ranks agree to stop after the
    warm-up round and one measured round, and their calls still pair up."""
    for r in run_ranks(_budget, 2):
        assert r["rounds"] == 2 and set(r["got"]) == {0, 1, 2, 3}
        assert r["sum"] == 3.0
