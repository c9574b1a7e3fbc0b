"""zerowatch's step decomposition against torch.profiler, on a larger run than the test's.

    .venv/bin/python bench/timing.py                     # stages 1, 2 (overlap), 3 (overlap)
    .venv/bin/python bench/timing.py --steps 20 --d-model 256

Two gloo ranks train a GPT with the bundled engine, instrumented (spooling to a temporary
folder, spans on every step) while torch.profiler records CPU activities; the engine labels
each phase `zerowatch::<phase>` for the profiler. Per step and rank it compares what
zerowatch reports with the profiler's intervals of the same phases: the step (first forward
to the end of the optimizer step), each phase's total, and each exclusive part recomputed
from the profiler's intervals with the agent's own rule (zerowatch.agent.probes.phases).
It prints, per stage, the median and p90 relative difference of each quantity, and the
share of (step, rank) samples within 10%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from zerowatch.agent.probes.phases import exclusive_parts
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch.examples.gpt import GPT, GPTConfig

WORLD = 2
STAGES = {
    "stage 1": {"stage": 1},
    "stage 2 (overlap)": {"stage": 2, "overlap_comm": True},
    "stage 3 (overlap)": {
        "stage": 3,
        "overlap_comm": True,
        "stage3_param_persistence_threshold": 0,
    },
}
QUANTITIES = ("step", "forward", "backward", "optimizer_step", "param_gather", "grad_reduce",
              "forward_compute", "backward_compute", "exposed_param_gather",
              "exposed_grad_reduce")  # fmt: skip


def _config(zero: dict[str, Any], micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }


def _rank(rank: int, args: argparse.Namespace, spool: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rdv", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))  # fmt: skip
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model,
                    n_layers=args.layers, n_heads=4, tied=False)  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    result = {}
    for name, zero in STAGES.items():
        torch.manual_seed(0)
        engine, *_ = zerowatch.initialize(model=GPT(cfg), config=_config(zero, args.micro_batch))

        def step(engine: Any = engine) -> None:
            x = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len), generator=g)
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()

        step()  # warm-up, outside the run and the profile
        with (
            zerowatch.instrument(engine, run=f"timing-{name}", spool_dir=spool,
                                 spans_every=1, flush_interval_s=0.1) as run,
            profile(activities=[ProfilerActivity.CPU]) as prof,
        ):  # fmt: skip
            for s in range(args.steps):
                with record_function(f"bench::step {s}"):
                    step()
        ranges = [(e.name, float(e.time_range.start), float(e.time_range.end))
                  for e in prof.events()
                  if e.name.startswith(("zerowatch::", "bench::step"))]  # fmt: skip
        result[name] = {"run_id": run.id, "ranges": ranges}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _profiled(ranges: list[tuple[str, float, float]]) -> list[dict[str, Any]]:
    out = []
    for a, b in sorted((a, b) for n, a, b in ranges if n.startswith("bench::step")):
        inside = [(n.removeprefix("zerowatch::"), s, e) for n, s, e in ranges
                  if n.startswith("zerowatch::") and a <= s and e <= b]  # fmt: skip
        t0 = min(s for n, s, _ in inside if n == "forward")
        t1 = max(e for n, _, e in inside if n == "optimizer_step")
        out.append({"step_s": (t1 - t0) / 1e6,
                    "intervals": [(n, (s - t0) / 1e6, (e - t0) / 1e6) for n, s, e in inside]})  # fmt: skip
    return out


def _spooled(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    events = []
    for seg in segments(run_dir / f"rank-{rank:05d}"):
        events.extend(o for _, o in read_events(seg) if o.get("kind") == "step")
    return sorted(events, key=lambda e: e["step"])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as spool, tempfile.TemporaryDirectory() as out:
        mp.get_context("spawn")
        mp.spawn(_rank, args=(args, spool, out), nprocs=WORLD, join=True)
        results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
        print(f"\n{args.steps} steps x {WORLD} ranks per stage; GPT d_model={args.d_model}, "
              f"seq_len={args.seq_len}, {args.layers} layers, micro-batch {args.micro_batch}; "
              f"load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
        print("| stage | quantity | median ms | median diff | p90 diff | within 10% |")
        print("|---|---|---:|---:|---:|---:|")
        for name in STAGES:
            diffs: dict[str, list[float]] = {q: [] for q in QUANTITIES}
            sizes: dict[str, list[float]] = {q: [] for q in QUANTITIES}
            for rank in range(WORLD):
                case = results[rank][name]
                for e, p in zip(_spooled(Path(spool) / case["run_id"], rank),
                                _profiled(case["ranges"]), strict=True):  # fmt: skip
                    parts = exclusive_parts(p["intervals"], p["step_s"])
                    pairs = {"step": (e["step_time_s"], p["step_s"])}
                    for ph in ("forward", "backward", "optimizer_step", "param_gather",
                               "grad_reduce"):  # fmt: skip
                        want = sum(b - a for n, a, b in p["intervals"] if n == ph)
                        pairs[ph] = (e["phases"].get(ph, 0.0), want)
                    for part in QUANTITIES[6:]:
                        pairs[part] = (e["parts"][part], parts[part])
                    for q, (got, want) in pairs.items():
                        if want > 0:
                            diffs[q].append(abs(got - want) / want)
                            sizes[q].append(want)
            for q in QUANTITIES:
                if not diffs[q]:
                    continue
                within = sum(d <= 0.10 for d in diffs[q]) / len(diffs[q])
                print(f"| {name} | {q} | {statistics.median(sizes[q]) * 1e3:.1f} | "
                      f"{statistics.median(diffs[q]):.1%} | {_pct(diffs[q], 0.9):.1%} | "
                      f"{within:.0%} |")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
