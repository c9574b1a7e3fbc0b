"""Model FLOPs utilisation without hand input: the device's peak and the model's FLOPs.

MFU = achieved model FLOP/s / (peak FLOP/s of a device x devices). Each rank reports its own
share: its tokens/s x model FLOPs per token / its device's peak, so the mean over the ranks
is the job's MFU (the same devices everywhere).

**Model FLOPs per token** (training: forward + backward), the PaLM paper's accounting
(Chowdhery et al. 2022, appendix B; Chinchilla and torchtitan count alike):

    6 N + 12 L H T

- 6 N: each parameter of a matrix multiply costs 2 FLOPs per token forward and 4 backward.
  N counts the parameters a token goes through in a matmul: the trainable parameters less
  the embedding tables (a lookup, no FLOPs), but a table that is also a Linear's weight (an
  LM head tied to the token embedding) stays in, since the head multiplies by it. In a
  mixture of experts a token runs through top_k of the E experts of a layer: the experts
  count k / E of their parameters, never all of them as if dense (an `experts` list beside
  a `top_k` / `num_experts_per_tok` / the gate's `k`: Mixtral, Qwen-MoE, DeepSeek,
  DeepSpeed's MoE layer). Under expert parallelism, give the FLOPs by hand.
- 12 L H T: the attention scores QK^T and their product with V, 2 x 2 L H T FLOPs forward,
  twice that backward, for L layers of width H (heads x head dim) over a sequence of T
  tokens (causal masking not discounted, as in PaLM).

What the module does not show is left out (the attention term without L, H or T) or
given by hand (`instrument(..., flops_per_token=...)`, or `flops_params`, `num_layers`,
`hidden_size`, `seq_len`); an MoE whose top-k cannot be read gives no MFU at all rather
than one counting every expert.

**Peak FLOP/s** come from `PEAK_FLOPS` by the device's name (torch.cuda.get_device_name)
and the dtype the matmuls run in; a device not in the table has no peak (None): no MFU,
never a guess. `instrument(..., peak_flops=...)` overrides the table.

An MFU above 1 means an input is wrong (a peak too low, tokens counted twice): the meter
reports None for it and logs the inputs once, instead of clamping.

Imports no torch at module level (the model is walked only when one is given).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Dense (no structured sparsity) peak FLOP/s of one GPU, per matmul dtype: bf16/fp16 and
#: tf32 on the tensor cores, fp32 on the CUDA cores. From NVIDIA's datasheets, whose tensor
#: core figures are "with sparsity" and are halved here:
#: - A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB alike): 19.5 TF fp32,
#:   156 tf32, 312 bf16/fp16.
#: - H100 Tensor Core GPU datasheet: SXM 67 / 494.5 / 989.5 (1,979 sparse); PCIe
#:   51 / 378 / 756 (1,513 sparse); NVL 60 / 417.5 / 835.5 (1,671 sparse).
#:   GH200 (its H100) as the H100 SXM.
#: - H200 Tensor Core GPU datasheet: H200 SXM as the H100 SXM; H200 NVL as the H100 NVL.
#: - HGX B200 datasheet (8-GPU totals / 8): 75 TF fp32, 1,125 tf32 (18 PF sparse for 8),
#:   2,250 bf16/fp16 (36 PF sparse for 8).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "H100 SXM": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
    "H100 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    "H200 SXM": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H200 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    "B200": {"fp32": 75e12, "tf32": 1125e12, "bf16": 2250e12, "fp16": 2250e12},
}

#: torch.cuda.get_device_name() -> the table's row; the first match wins (NVL before the
#: plain names). E.g. "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB
#: HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA B200".
_DEVICE_ROWS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), row)
    for pattern, row in (
        (r"\bA100\b", "A100"),
        (r"\bH100\b.*\bNVL\b", "H100 NVL"),
        (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
        (r"\bH100\b.*(\bSXM|\bHBM3)", "H100 SXM"),
        (r"\bGH200\b", "H100 SXM"),
        (r"\bH200\b.*\bNVL\b", "H200 NVL"),
        (r"\bH200\b", "H200 SXM"),
        (r"\bB200\b", "B200"),
    )
)

#: Attribute names that give a transformer's layers, width and training sequence length on
#: common model classes or their config (zerowatch.examples.gpt, nanoGPT, Hugging Face).
_LAYERS = ("n_layers", "n_layer", "num_hidden_layers", "num_layers")
_WIDTH = ("d_model", "n_embd", "hidden_size")
_SEQ = ("seq_len", "block_size", "n_ctx", "max_seq_len")
#: Where an MoE block keeps its top-k (Mixtral, Qwen-MoE, DeepSeek, DeepSpeed's gate).
_TOP_K = ("top_k", "num_experts_per_tok", "topk", "moe_top_k", "k")
#: An MoE block's count of experts, where one is named.
_N_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def device_row(device_name: str | None) -> str | None:
    """The `PEAK_FLOPS` row of a device name, or None for a device not listed."""
    if not device_name:
        return None
    for pattern, row in _DEVICE_ROWS:
        if pattern.search(device_name):
            return row
    return None


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of that name for matmuls in `dtype` ("bf16", "fp16",
    "tf32", "fp32"); None when the device or the dtype is not in the table."""
    row = device_row(device_name)
    return None if row is None else PEAK_FLOPS[row].get(dtype)


def matmul_dtype(precision: str) -> str:
    """The dtype a run's matmuls run in: its precision, fp32 as tf32 where torch lets the
    tensor cores take fp32 matmuls (`torch.backends.cuda.matmul.allow_tf32`)."""
    if precision != "fp32":
        return precision
    try:
        import torch

        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    except Exception:
        return "fp32"


def flops_per_token(
    num_params: int,
    *,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    seq_len: int | float | None = None,
) -> float:
    """6·N, plus 12·L·H·T when the three model dimensions are known."""
    flops = 6.0 * num_params
    if num_layers and hidden_size and seq_len:
        flops += 12.0 * num_layers * hidden_size * seq_len
    return flops


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOPs of a token are made of (see the module docstring)."""

    #: N: parameters a token multiplies by (embeddings out, experts at k / E).
    params: int
    num_layers: int | None = None
    hidden_size: int | None = None
    #: T, when the model says it; else the step's tokens per sample (`per_token`).
    seq_len: int | None = None
    #: A mixture of experts was found (and counted by its top-k).
    moe: bool = False

    def per_token(self, seq_len: float | None = None) -> float:
        """FLOPs per token, with `seq_len` where the model did not give T."""
        return flops_per_token(self.params, num_layers=self.num_layers,
                               hidden_size=self.hidden_size, seq_len=self.seq_len or seq_len)  # fmt: skip


def _first_int(objs: list[Any], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _expert_list(m: Any, module_list: Any) -> Any:
    """The experts of an MoE block: its `experts` ModuleList (Mixtral, Qwen-MoE, DeepSeek),
    or the list inside its `experts` module (DeepSpeed's `Experts.deepspeed_experts`, which
    also answers for itself); None for a module that holds no such list."""
    names = ("experts", "deepspeed_experts", "local_experts")
    for holder in (m, getattr(m, "experts", None)):
        for name in names:
            experts = getattr(holder, name, None)
            if isinstance(experts, module_list) and len(experts) >= 2:
                return experts
    return None


def _numel(p: Any) -> int:
    """A parameter's full size, also when a ZeRO-3 engine holds only its shard
    (DeepSpeed's `ds_numel`)."""
    return int(getattr(p, "ds_numel", 0) or p.numel())


def model_flops(module: Any, *, param_count: int | None = None) -> ModelFlops | None:
    """The FLOPs accounting of `module` (an nn.Module); None when it cannot be made honestly
    (an MoE whose top-k is not found).

    Args:
        module: the model (for an engine, its `.module`).
        param_count: the trainable parameters as the engine counts them (full sizes also
            under ZeRO-3); default: the module's own trainable parameters.
    """
    from torch import nn

    params = {id(p): p for p in module.parameters() if p.requires_grad}
    total = param_count if param_count else sum(_numel(p) for p in params.values())
    in_matmul = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    embedded = 0
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            w = m.weight
            if id(w) in params and id(w) not in in_matmul:
                embedded += int(m.num_embeddings) * int(m.embedding_dim)
    inactive, moe, seen = 0, False, set()
    for m in module.modules():
        experts = _expert_list(m, nn.ModuleList)
        if experts is None:
            if _first_int([m], _N_EXPERTS) not in (None, 1) and not isinstance(m, nn.ModuleList):
                return None  # experts we cannot find to count by their top-k
            continue
        if id(experts) in seen:
            continue
        seen.add(id(experts))
        moe = True
        k = _first_int([m, getattr(m, "gate", None), getattr(m, "router", None)], _TOP_K)
        if k is None:
            return None
        n_expert = sum(_numel(p) for p in experts.parameters() if id(p) in params)
        inactive += n_expert - n_expert * min(k, len(experts)) // len(experts)
    config = [module, getattr(module, "cfg", None), getattr(module, "config", None)]
    return ModelFlops(
        params=max(int(total) - embedded - inactive, 0),
        num_layers=_first_int(config, _LAYERS),
        hidden_size=_first_int(config, _WIDTH),
        seq_len=_first_int(config, _SEQ),
        moe=moe,
    )


def mfu(
    tokens_per_s: float | None, per_token_flops: float, peak_flops: float | None
) -> float | None:
    """Fraction of the device's peak FLOP/s the step achieved; None without tokens or peak."""
    if not tokens_per_s or not peak_flops or per_token_flops <= 0:
        return None
    return tokens_per_s * per_token_flops / peak_flops


class MfuMeter:
    """One rank's MFU per step, from its tokens/s.

    Refuses an MFU above 1 (None, and one warning with the inputs): such a value is a
    wrong input, and a clamped 1.0 would hide it.
    """

    def __init__(
        self,
        *,
        model: ModelFlops | None,
        peak_flops: float | None,
        flops_per_token: float | None = None,
        warn_once: Callable[..., None],
        device_name: str | None = None,
    ) -> None:
        self.model = model
        self.peak_flops = peak_flops
        self.fixed_per_token = flops_per_token
        self.device_name = device_name
        self._warn_once = warn_once

    def per_token(self, seq_len: float | None = None) -> float | None:
        """Model FLOPs per token (the override, else the model's accounting)."""
        if self.fixed_per_token is not None:
            return self.fixed_per_token
        return self.model.per_token(seq_len) if self.model is not None else None

    def __call__(self, tokens_per_s: float | None, seq_len: float | None = None) -> float | None:
        per_token = self.per_token(seq_len)
        if per_token is None:
            return None
        value = mfu(tokens_per_s, per_token, self.peak_flops)
        if value is not None and value > 1.0:
            self._warn_once(
                "mfu-above-1",
                "zerowatch agent: MFU %.3f > 1 is impossible, not reported: tokens/s %.6g x "
                "FLOPs/token %.6g (model %r) / peak FLOP/s %.6g (device %r); give "
                "instrument(peak_flops=..., flops_per_token=...) if one of them is wrong",
                value, tokens_per_s, per_token, self.model, self.peak_flops, self.device_name,
            )  # fmt: skip
            return None
        return value


__all__ = [
    "PEAK_FLOPS",
    "MfuMeter",
    "ModelFlops",
    "device_row",
    "flops_per_token",
    "matmul_dtype",
    "mfu",
    "model_flops",
    "peak_flops",
]
