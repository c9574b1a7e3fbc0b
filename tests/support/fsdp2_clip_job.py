"""A two-rank gloo FSDP2 job that clips with `torch.nn.utils.clip_grad_norm_`, for the
FSDP2 grad-norm tests.

    results = run_job(fsdp2_clip_worker, out_dir, server=url, configs=["fp32"], steps=5)

Each rank writes `<out_dir>/fsdp2_clip-rank<r>.json`: the run id, per step the total norm
the script's own clip_grad_norm_ call returned (None on a step that does not clip) with
its max_norm, and the adapter's step stats read right after the optimizer step; whether
clip_grad_norm_ is torch's own function again after the run, the warnings filter list
before, during and after the run, and how many of torch's backward-hook notes reached
the script.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from support.foreign_jobs import _join, mlp

#: max_norm per step: far above the norm (not clipped), far below (clipped); None: the
#: step does not clip, but the script calls clip_grad_norm_ before the step's forward
#: (outside any step, so it must not count).
MAX_NORMS: list[float | None] = [1e9, 1e-6, 1e9, 1e-6, None]
NOTE = "Full backward hook is firing"


def _filters() -> list[str]:
    return [repr(f) for f in warnings.filters]


def fsdp2_clip_worker(rank: int, world: int, port: int, out_dir: str, server: str | None,
                      configs: list[str], steps: int, batch: int,
                      instrument: bool = True) -> None:  # fmt: skip
    """One rank: an FSDP2 MLP with AdamW, clipping each step with `MAX_NORMS[step]`."""
    _join(rank, world, port)
    import torch
    import torch.distributed as dist
    import torch.nn.utils.clip_grad
    from torch.distributed.fsdp import fully_shard

    import zerowatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    originals = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")  # every note torch gives would reach the script
        before = _filters()
        model = mlp(width=64, depth=2)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = zerowatch.instrument(model, optimizer=opt, server=server, run="fsdp2-clip",
                                   spool_dir=Path(out_dir) / "spool", spans_every=0,
                                   flush_interval_s=0.1)  # fmt: skip
        gen = torch.Generator().manual_seed(1 + rank)
        per_step = []
        during = []
        for i in range(steps):
            max_norm = MAX_NORMS[i % len(MAX_NORMS)]
            if max_norm is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # between steps
            x = torch.randn(batch, 64, generator=gen)
            loss = model(x).pow(2).mean()
            loss.backward()
            norm = None
            if max_norm is not None:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                # The returned norm is replicated: its local tensor is the norm, no collective.
                norm = float(total.to_local() if hasattr(total, "to_local") else total)
            opt.step()
            opt.zero_grad()
            stats = run._adapter.step_stats()
            per_step.append({"norm": norm, "max_norm": max_norm, "stats": {
                "grad_norm": stats.grad_norm, "clipped": stats.clipped,
                "nonfinite": stats.nonfinite}})  # fmt: skip
            during.append(_filters())
        result["run_id"] = run.id
        run.close()
        result["steps"] = per_step
        result["filters_unchanged_during"] = all(f == before for f in during)
        result["filters_unchanged_after"] = _filters() == before
        result["notes_shown"] = sum(NOTE in str(w.message) for w in shown)
    result["clip_restored"] = (
        torch.nn.utils.clip_grad_norm_ is originals[0]
        and torch.nn.utils.clip_grad.clip_grad_norm_ is originals[1]
        and not getattr(torch.nn.utils.clip_grad_norm_, "__zerowatch__", False)
    )
    Path(out_dir, f"fsdp2_clip-rank{rank}.json").write_text(json.dumps({"fp32": result}))
    dist.destroy_process_group()


__all__ = ["MAX_NORMS", "fsdp2_clip_worker"]
