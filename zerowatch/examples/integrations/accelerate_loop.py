"""An Accelerate training loop watched by zerowatch: `zerowatch.instrument(accelerator)`.

    torchrun --nproc-per-node 2 -m zerowatch.examples.integrations.accelerate_loop \\
        --strategy ddp --server http://127.0.0.1:8321

The tiny GPT-2 of hf_trainer.py on CPU with gloo. `--strategy` picks the Accelerator:
`ddp` (`prepare` builds DDP), `fsdp2` (an FSDP2 plugin: `prepare` shards the model with
`fully_shard`; Accelerate applies it on GPUs only) or `deepspeed-zero2` (a DeepSpeed plugin:
`prepare` builds a DeepSpeed engine; on CPU with `DS_ACCELERATOR=cpu`). The zerowatch part
is the `zerowatch.instrument(accelerator)` line and `zw.log` in the loop.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

import zerowatch
from zerowatch.examples.integrations.hf_trainer import (
    RandomTokens,
    run_from_command_line,
    tiny_gpt2,
)

STRATEGIES = ("ddp", "fsdp2", "deepspeed-zero2")


def accelerator_for(strategy: str) -> Accelerator:
    """The Accelerator for `strategy`; `prepare` then builds DDP, FSDP2 or a DeepSpeed engine.

    `cpu=True` would give Accelerate's MULTI_CPU state, which applies neither plugin, so the
    plugins go on the GPU path. There, without a GPU, Accelerate finds no backend of its own
    and counts one process; naming gloo there makes it count the torchrun world (the data is
    then sharded and `reduce(..., "mean")` divides by the number of ranks).
    """
    from accelerate.utils import (
        DeepSpeedPlugin,
        FullyShardedDataParallelPlugin,
        InitProcessGroupKwargs,
    )

    gloo = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    if strategy == "ddp":
        return Accelerator(cpu=True)
    if strategy == "fsdp2":
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=True, transformer_cls_names_to_wrap=["GPT2Block"]
        )
        return Accelerator(fsdp_plugin=fsdp, kwargs_handlers=gloo)
    if strategy == "deepspeed-zero2":
        zero2 = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0)
        return Accelerator(deepspeed_plugin=zero2, kwargs_handlers=gloo)
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
        # The rate this step uses, read before backward: a DeepSpeed engine steps its
        # optimizer and scheduler inside `accelerator.backward`.
        lr = scheduler.get_last_lr()[0]
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed: its config clips
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean_loss = accelerator.reduce(loss.detach(), "mean").item()
        zw.log(loss=mean_loss, lr=lr)
        logged.append({"step": step, "loss": mean_loss, "lr": lr})
    zw.close()
    return zw, logged


def main() -> None:
    run_from_command_line(__doc__ or "", STRATEGIES, train)


if __name__ == "__main__":
    main()
