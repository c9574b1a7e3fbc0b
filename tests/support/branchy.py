"""A model whose parameters each rank uses differently: an embedding, two equal-sized
branches and a head. A batch names its branch, so each rank can train its own branch (the
way MoE routing or a conditional block leaves some parameters without a gradient on some
ranks), and one plain process can train the same global batch as the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ, MICRO_BATCH = 33, 16, 8, 2
LR, WEIGHT_DECAY = 1e-2, 0.1


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TwoBranch(nn.Module):
    """emb -> branch[b] (residual) -> head; the branches have identical shapes, so a
    collective of one branch's tensors pairs with the other's without an error."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.branches = nn.ModuleList([Mlp(WIDTH), Mlp(WIDTH)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, branch: int) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.branches[branch](h)
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_model() -> TwoBranch:
    torch.manual_seed(0)
    return TwoBranch()


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank `rank`'s micro-batch of step `step` and its branch (rank parity)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    return x, y, rank % 2


def reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    """One process: every rank's micro-batch through its branch, the mean of their losses."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for s in range(steps):
        opt.zero_grad()
        loss = sum(model(*rank_batch(s, r)) for r in range(world)) / world
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
