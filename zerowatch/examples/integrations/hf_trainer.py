"""A Hugging Face Trainer run watched by zerowatch: one callback.

    torchrun --nproc-per-node 2 -m zerowatch.examples.integrations.hf_trainer \\
        --strategy deepspeed-zero3 --server http://127.0.0.1:8321

A tiny GPT-2 (built from `GPT2Config`, nothing downloaded) learns random tokens on CPU with
gloo. `--strategy` picks what the Trainer builds: `ddp`, `fsdp2`, `deepspeed-zero2` or
`deepspeed-zero3` (DeepSpeed on CPU needs `DS_ACCELERATOR=cpu`). The zerowatch part is the
`callbacks=[ZeroWatchCallback(...)]` line; the rest is an ordinary Trainer script.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zerowatch.integrations.transformers import ZeroWatchCallback

STRATEGIES = ("ddp", "fsdp2", "deepspeed-zero2", "deepspeed-zero3")


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """`n` sequences of `seq_len` random tokens (the labels are the tokens)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64)
    return GPT2LMHeadModel(config)


def strategy_args(strategy: str) -> dict[str, Any]:
    """The TrainingArguments that make the Trainer build `strategy`."""
    if strategy == "ddp":
        return {}
    if strategy == "fsdp2":
        # FSDP2 is the default `version`; reshard_after_forward=True is FULL_SHARD (ZeRO-3).
        return {"fsdp": True, "fsdp_config": {
            "version": 2, "reshard_after_forward": True,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
        }}  # fmt: skip
    if strategy.startswith("deepspeed-zero"):
        stage = int(strategy[-1])
        return {"deepspeed": {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
        }}  # fmt: skip
    raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")


def train(strategy: str, *, steps: int = 10, server: str | None = None,
          run: str | None = None, output_dir: str = "hf-trainer-out") -> Trainer:  # fmt: skip
    """Train the tiny GPT-2 for `steps` optimizer steps; the Trainer, trained."""
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        # use_cpu=True gives Accelerate's MULTI_CPU state, where it applies neither DeepSpeed
        # nor FSDP: those two are asked for on the GPU path (DeepSpeed then runs on CPU with
        # DS_ACCELERATOR=cpu; FSDP is refused, see docs/integrations.md).
        use_cpu=strategy == "ddp",
        ddp_backend="gloo",
        dataloader_num_workers=0,
        **strategy_args(strategy),
    )
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=RandomTokens(n=64, seq_len=32, vocab=256),
        callbacks=[ZeroWatchCallback(server=server, run=run or f"hf-{strategy}")],
    )
    trainer.train()
    return trainer


def run_from_command_line(doc: str, strategies: tuple[str, ...], train: Any) -> None:
    """`train(strategy, steps=, server=)` with `--strategy`, `--steps` and `--server` from the
    command line (every example's `main`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--strategy", choices=strategies, default="ddp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--server", default=os.environ.get("ZEROWATCH_SERVER"))
    a = parser.parse_args()
    train(a.strategy, steps=a.steps, server=a.server)


def main() -> None:
    run_from_command_line(__doc__ or "", STRATEGIES, train)


if __name__ == "__main__":
    main()
