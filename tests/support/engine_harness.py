"""Multi-rank harness for the engine tests: spawn N gloo ranks once and run many scenarios
in them (process start-up is the expensive part on a small CPU machine).

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in N spawned
processes joined by gloo and returns each rank's return value (picklable), or raises with
the failing rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, out_dir: str, fn: Callable[..., Any],
           args: tuple[Any, ...], timeout_s: float) -> None:  # fmt: skip
    torch.set_num_threads(1)
    os.environ["ZEROWATCH_COMM_TIMEOUT_S"] = str(timeout_s)
    result: dict[str, Any]
    try:
        # Rendezvous through a file in the job's own directory: no port to pick, so jobs
        # started side by side cannot collide.
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))  # fmt: skip
        result = {"ok": fn(rank, world_size, *args)}
    except BaseException:  # reported to the parent, which raises it
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if dist.is_initialized() and "ok" in result:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
              may_die: frozenset[int] = frozenset()) -> list[Any]:  # fmt: skip
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; each rank's result
    (None for a rank in `may_die` that left no result)."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, world_size, out, fn, args, timeout_s))
                 for r in range(world_size)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s * 10)
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world_size):
            f = Path(out) / f"rank{r}.pt"
            if not f.exists() and r in may_die:
                results.append(None)
                continue
            if not f.exists():
                raise RuntimeError(f"rank {r} produced no result (exit code {procs[r].exitcode})")
            res = torch.load(f, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
