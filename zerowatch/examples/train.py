"""An instrumented ZeRO training of the small GPT-like model, launched by torchrun.

    torchrun --nproc-per-node 2 -m zerowatch.examples.train --stage 3 --steps 30 \\
        --server http://127.0.0.1:8321

This is what `zerowatch demo` runs for each stage, and the shape of a user's script: build
the model, `zerowatch.initialize` with a DeepSpeed config, `zerowatch.instrument`, train.
Every rank draws its own micro-batches (seeded by rank and step), as a data-parallel loader
with a DistributedSampler would.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

import zerowatch
from zerowatch.examples.gpt import GPT, GPTConfig, random_batch


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed-style config for one run of the demo."""
    zero: dict[str, Any] = {
        "stage": args.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 2e5,
        "allgather_bucket_size": 2e5,
        "stage3_prefetch_bucket_size": 2e5,
        # Keep only LayerNorms and biases whole, as DeepSpeed's "auto" (10 * hidden) would.
        "stage3_param_persistence_threshold": 10 * args.d_model,
    }
    if args.offload != "none":
        zero["offload_optimizer"] = {"device": args.offload}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": args.precision == "fp16", "initial_scale_power": 12},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(args.steps, 2),
                "warmup_num_steps": max(args.steps // 10, 1),
            },
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--offload", default="none", choices=("none", "cpu"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--server", default=None, help="zerowatch server URL (default $ZEROWATCH_SERVER)"
    )
    p.add_argument("--name", default=None, help="run name")
    p.add_argument("--project", default="default")
    p.add_argument("--tag", action="append", default=[], help="run tag (repeatable)")
    p.add_argument("--spool-dir", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model,
                    n_layers=args.layers, n_heads=4)  # fmt: skip
    model = GPT(cfg)
    engine, _, _, _ = zerowatch.initialize(model=model, config=ds_config(args))
    rank = engine.rank
    tags = [f"stage{args.stage}", *args.tag]
    with zerowatch.instrument(
        engine, server=args.server, run=args.name, project=args.project, tags=tags,
        spool_dir=args.spool_dir, num_layers=args.layers, hidden_size=args.d_model, seq_len=args.seq_len,
    ) as run:  # fmt: skip
        for step in range(args.steps):
            for micro in range(args.grad_accum):
                x, y = random_batch(
                    cfg, args.micro_batch, seed=(step * args.grad_accum + micro) * 1000 + rank
                )
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            run.log(loss=loss.item(), tokens=args.micro_batch * args.grad_accum * args.seq_len)
        if rank == 0 and os.environ.get("ZEROWATCH_PRINT_RUN"):
            print(f"run {run.id}", flush=True)


if __name__ == "__main__":
    main()
