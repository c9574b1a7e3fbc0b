"""An Accelerate training loop watched by zerowatch: `zerowatch.instrument(accelerator)`.

    torchrun --nproc-per-node 2 -m zerowatch.examples.integrations.accelerate_loop \\
        --strategy ddp --server http://127.0.0.1:8321

The tiny GPT-2 of hf_trainer.py on CPU with gloo, data-parallel (`prepare` builds DDP).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from accelerate import Accelerator

import zerowatch
from zerowatch.examples.integrations.hf_trainer import RandomTokens, tiny_gpt2

STRATEGIES = ("ddp",)


def accelerator_for(strategy: str) -> Accelerator:
    """The Accelerator for `strategy`. On GPUs, an `fsdp_plugin=` or `deepspeed_plugin=`
    here makes `prepare` build FSDP2 or a DeepSpeed engine, and the same
    `zerowatch.instrument(accelerator)` records it (Accelerate applies neither on CPU)."""
    if strategy == "ddp":
        return Accelerator(cpu=True)
    raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")


def train(strategy: str, *, steps: int = 10, server: str | None = None,
          run: str | None = None) -> tuple[Any, list[dict[str, Any]]]:  # fmt: skip
    """Train for `steps` steps; (the zerowatch run, what each step logged)."""
    accelerator = accelerator_for(strategy)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    data = torch.utils.data.DataLoader(RandomTokens(n=128, seq_len=32, vocab=256), batch_size=4)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

    zw = zerowatch.instrument(accelerator, server=server, run=run or f"accelerate-{strategy}")
    logged: list[dict[str, Any]] = []
    batches = iter(data)
    for step in range(steps):
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        lr = scheduler.get_last_lr()[0]  # the rate this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean_loss = accelerator.reduce(loss.detach(), "mean").item()
        zw.log(loss=mean_loss, lr=lr)
        logged.append({"step": step, "loss": mean_loss, "lr": lr})
    zw.close()
    return zw, logged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--server", default=os.environ.get("ZEROWATCH_SERVER"))
    a = parser.parse_args()
    train(a.strategy, steps=a.steps, server=a.server)


if __name__ == "__main__":
    main()
