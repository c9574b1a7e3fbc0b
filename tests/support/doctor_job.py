"""A training job with a fault to diagnose, for the doctor's scenario tests and bench/doctor.py.

    torchrun --nproc-per-node 2 tests/support/doctor_job.py --server URL --slow-rank 1 \\
        --slow-forward-s 0.05

It trains the example GPT (zerowatch.examples) like `zerowatch.examples.train`, with the
example's DeepSpeed config, and can make one thing go wrong:

- `--slow-rank R --slow-forward-s S`: rank R sleeps S seconds in every forward (a forward
  pre-hook on the model), a compute straggler;
- `--input-sleep-s S`: every rank (or only `--input-rank R`) sleeps S seconds between steps,
  outside the engine, as a slow data loader would;
- `--reduce-bucket-size N`, `--prefetch-bucket-size N`, `--allgather-bucket-size N`: the
  ZeRO buckets (elements);
- `--overflow`: fp16 gradients overflow in every step (the loss is multiplied by 1e9 before
  backward), so the dynamic loss scale halves down to its floor and every step is skipped.

Rank 0 prints `run <id>` at the end (ZEROWATCH_PRINT_RUN is not needed).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import zerowatch
from zerowatch.examples.gpt import GPT, GPTConfig, random_batch
from zerowatch.examples.train import ds_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--offload", default="none", choices=("none", "cpu"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--server", required=True)
    p.add_argument("--name", default="doctor job")
    p.add_argument("--project", default="doctor")
    p.add_argument("--tag", action="append", default=[])
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-forward-s", type=float, default=0.0)
    p.add_argument("--input-sleep-s", type=float, default=0.0)
    p.add_argument("--input-rank", type=int, default=None, help="only this rank sleeps")
    p.add_argument("--reduce-bucket-size", type=float, default=None)
    p.add_argument("--allgather-bucket-size", type=float, default=None)
    p.add_argument("--prefetch-bucket-size", type=float, default=None)
    p.add_argument("--overflow", action="store_true")
    p.add_argument("--config-json", default=None, help="JSON merged into zero_optimization")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The example's config with this job's buckets."""
    base = argparse.Namespace(**{**vars(args), "offload": args.offload})
    cfg = ds_config(base)
    zero = cfg["zero_optimization"]
    for key, value in (
        ("reduce_bucket_size", args.reduce_bucket_size),
        ("allgather_bucket_size", args.allgather_bucket_size),
        ("stage3_prefetch_bucket_size", args.prefetch_bucket_size),
    ):
        if value is not None:
            zero[key] = value
    if args.config_json:
        zero.update(json.loads(args.config_json))
    return cfg


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model,
                    n_layers=args.layers, n_heads=4)  # fmt: skip
    engine, _, _, _ = zerowatch.initialize(model=GPT(cfg), config=config(args))
    rank = engine.rank
    if args.slow_rank == rank and args.slow_forward_s > 0:
        engine.module.register_forward_pre_hook(lambda *_: time.sleep(args.slow_forward_s))
    sleeps = args.input_sleep_s > 0 and args.input_rank in (None, rank)
    with zerowatch.instrument(
        engine, server=args.server, run=args.name, project=args.project, tags=args.tag,
        num_layers=args.layers, hidden_size=args.d_model, seq_len=args.seq_len,
    ) as run:  # fmt: skip
        for step in range(args.steps):
            if sleeps:
                time.sleep(args.input_sleep_s)  # the "data loader"
            for micro in range(args.grad_accum):
                x, y = random_batch(
                    cfg, args.micro_batch, seed=(step * args.grad_accum + micro) * 1000 + rank
                )
                loss = engine(x, y)
                engine.backward(loss.float() * 1e9 if args.overflow else loss)
                engine.step()
            run.log(loss=loss.item(), tokens=args.micro_batch * args.grad_accum * args.seq_len)
        if rank == 0:
            print(f"run {run.id}", flush=True)


if __name__ == "__main__":
    main()
