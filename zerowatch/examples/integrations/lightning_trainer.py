"""A Lightning Trainer run watched by zerowatch: one callback.

    torchrun --nproc-per-node 2 -m zerowatch.examples.integrations.lightning_trainer \\
        --strategy ddp --server http://127.0.0.1:8321

The tiny GPT-2 of hf_trainer.py in a LightningModule, on CPU with gloo. `--strategy`:
`ddp`, `fsdp` (Lightning's FSDPStrategy) or `deepspeed` (Lightning's DeepSpeedStrategy,
ZeRO-2: it needs CUDA GPUs). The zerowatch part is `callbacks=[ZeroWatchCallback(...)]`.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch

from zerowatch.examples.integrations.hf_trainer import (
    RandomTokens,
    run_from_command_line,
    tiny_gpt2,
)
from zerowatch.integrations.lightning import ZeroWatchCallback

STRATEGIES = ("ddp", "fsdp", "deepspeed")


class TinyGPT(L.LightningModule):  # type: ignore[misc]
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.model = tiny_gpt2()
        self.steps = steps
        #: What each training step computed on this rank: step, loss, lr.
        self.logged: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.logged.append({"step": self.global_step, "loss": loss.item(), "lr": lr})
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def strategy_for(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if name == "fsdp":
        return FSDPStrategy(process_group_backend="gloo")
    if name == "deepspeed":
        return DeepSpeedStrategy(stage=2, process_group_backend="gloo")
    raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {name!r}")


def train(strategy: str, *, steps: int = 10, server: str | None = None,
          run: str | None = None, root_dir: str = "lightning-out") -> tuple[L.Trainer, TinyGPT]:  # fmt: skip
    """Train for `steps` optimizer steps; (the Trainer, the module), trained."""
    module = TinyGPT(steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy_for(strategy),
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root_dir,
        callbacks=[ZeroWatchCallback(server=server, run=run or f"lightning-{strategy}")],
    )
    data = torch.utils.data.DataLoader(RandomTokens(n=64, seq_len=32, vocab=256), batch_size=4)
    trainer.fit(module, data)
    return trainer, module


def main() -> None:
    run_from_command_line(__doc__ or "", STRATEGIES, train)


if __name__ == "__main__":
    main()
