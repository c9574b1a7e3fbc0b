"""Model FLOPs utilisation, counted as torchtitan does.

Training FLOPs per token are 6·N for the matmuls of N parameters (2 forward, 4 backward)
plus, for self-attention, 12·L·H·T (the QKᵀ and AV products of L layers of width H over a
sequence of T tokens, forward and backward). MFU = tokens/s · FLOPs per token / peak FLOP/s
of the device, per rank. Standard library only.
"""

from __future__ import annotations


def flops_per_token(
    num_params: int,
    *,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    seq_len: int | None = None,
) -> float:
    """6·N, plus 12·L·H·T when the three model dimensions are known."""
    flops = 6.0 * num_params
    if num_layers and hidden_size and seq_len:
        flops += 12.0 * num_layers * hidden_size * seq_len
    return flops


def mfu(
    tokens_per_s: float | None, per_token_flops: float, peak_flops: float | None
) -> float | None:
    """Fraction of the device's peak FLOP/s the step achieved; None without tokens or peak."""
    if not tokens_per_s or not peak_flops or per_token_flops <= 0:
        return None
    return tokens_per_s * per_token_flops / peak_flops


__all__ = ["flops_per_token", "mfu"]
