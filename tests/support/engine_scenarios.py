"""Training scenarios for the engine tests, run inside spawned gloo ranks (and the plain
single-process reference they are compared with). Models are tiny: the point is the
arithmetic, not the speed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import zerowatch
from zerowatch.examples.gpt import GPT, GPTConfig, random_batch

TINY = GPTConfig(vocab_size=33, seq_len=8, d_model=16, n_layers=2, n_heads=2, tied=False)
MICRO_BATCH = 2
#: CLIP sits inside the range of the tiny runs' global gradient norms (about 0.6-0.9 at
#: accumulation 1, 0.3-0.5 at 4), so that clipping acts in every matrix case (and at
#: accumulation 4 on some steps, not others: both branches).
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.4


def ds_config(stage: int, *, ga: int = 1, precision: str = "fp32", offload_optimizer: bool = False,
              offload_param: bool = False, overlap: bool = False, bucket: int = 600,
              persistence: int = 40, clip: float = CLIP, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A DeepSpeed-style config dict for the tiny runs."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": overlap,
            "reduce_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": persistence,
            "offload_optimizer": {"device": "cpu" if offload_optimizer else "none"},
            "offload_param": {"device": "cpu" if offload_param else "none"},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
    }
    cfg.update(extra)
    return cfg


def micro_batches(cfg: GPTConfig, step: int, ga: int, world: int, rank: int):
    """This rank's micro-batches of global step `step` (the global batch is split by
    micro-batch, then by rank)."""
    x, y = random_batch(cfg, MICRO_BATCH * ga * world, seed=1000 + step)
    for m in range(ga):
        lo = (m * world + rank) * MICRO_BATCH
        yield x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH]


@dataclass
class Run:
    """What a scenario reports back from a rank (`state_dict`: the consolidated weights on
    rank 0, {} on the other ranks; `extra["local"]`: what the rank holds whole)."""

    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def train_engine(engine: Any, cfg: GPTConfig, steps: int, ga: int, world: int, rank: int,
                 start: int = 0) -> list[float]:  # fmt: skip
    losses = []
    for s in range(start, start + steps):
        total = 0.0
        for x, y in micro_batches(cfg, s, ga, world, rank):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / ga
        losses.append(total)
    return losses


def make_model(
    cfg: GPTConfig = TINY, build: Callable[[GPTConfig], nn.Module] | None = None
) -> nn.Module:
    torch.manual_seed(0)
    return build(cfg) if build is not None else GPT(cfg)


def engine_run(rank: int, world: int, config: dict[str, Any], steps: int = 20,
               cfg: GPTConfig = TINY, build: Any = None) -> Run:  # fmt: skip
    model = make_model(cfg, build)
    engine, *_ = zerowatch.initialize(model=model, config=config)
    ga = config["gradient_accumulation_steps"]
    losses = train_engine(engine, cfg, steps, ga, world, rank)
    return Run(engine.consolidated_state_dict(), losses, {"local": local_state(engine)})


def local_state(engine: Any) -> dict[str, torch.Tensor]:
    """What this rank holds whole of the model, in fp32: every parameter at stages 0-2,
    the persistent ones at stage 3 (released stage-3 parameters are empty), and buffers;
    what ranks compare, since only rank 0 gets the consolidated weights."""
    return {k: v.detach().float().clone()
            for k, v in engine.module.state_dict().items() if v.numel()}  # fmt: skip


def reference_run(ga: int, world: int, steps: int = 20, cfg: GPTConfig = TINY, build: Any = None,
                  clip: float = CLIP) -> Run:  # fmt: skip
    """One process, the plain model, torch AdamW, the same global batches."""
    model = make_model(cfg, build)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, grad_norms = [], []
    for s in range(steps):
        x, y = random_batch(cfg, MICRO_BATCH * ga * world, seed=1000 + s)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Run(state, losses, {"grad_norms": grad_norms})


def max_relative_error(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest per-tensor ||got - want|| / ||want|| over the state dict, and its key."""
    worst, key = 0.0, ""
    assert set(got) == set(want), set(got) ^ set(want)
    for k, w in want.items():
        g = got[k].float()
        err = float((g - w.float()).norm() / w.float().norm().clamp_min(1e-12))
        if err > worst:
            worst, key = err, k
    return worst, key


# -- odd models ------------------------------------------------------------------------------

#: Sizes that do not divide by 2 or 4 ranks (9 * 37 = 333 embedding elements, 9-wide norms).
ODD = GPTConfig(vocab_size=37, seq_len=7, d_model=9, n_layers=2, n_heads=3, tied=False)
TIED = GPTConfig(vocab_size=33, seq_len=8, d_model=16, n_layers=2, n_heads=2, tied=True)


def build_frozen(cfg: GPTConfig) -> nn.Module:
    """Position embedding frozen: not trained, not sharded, not in the optimizer."""
    model = GPT(cfg)
    model.pos_emb.weight.requires_grad_(False)
    return model


class BufferedGPT(GPT):
    """A persistent buffer that differs per rank at construction: the engine must start
    every rank from rank 0's value (and keep it in checkpoints and state dicts)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.temperature: torch.Tensor
        self.register_buffer("temperature", torch.tensor(1.5 + rank))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(idx, None) / self.temperature
        if targets is None:
            return out
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]),
                                                 targets.reshape(-1))  # fmt: skip


class TwiceGPT(GPT):
    """Runs the first block twice in one forward (a module called twice)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(self.positions[:t])
        x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))  # fmt: skip


class AllOddGPT(TwiceGPT):
    """Tied, frozen, buffered and twice-called at once."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.pos_emb.weight.requires_grad_(False)
        self.register_buffer("shift", torch.full((cfg.vocab_size,), 0.1))
