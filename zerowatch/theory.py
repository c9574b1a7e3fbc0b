"""The ZeRO memory and communication model (Rajbhandari et al., 2019), per rank and step.

Model states of mixed-precision Adam, per parameter (Ψ parameters, N data-parallel ranks):

    parameters        2 bytes (bf16/fp16)      4 bytes (fp32)
    gradients         2 bytes                  4 bytes
    master weights    4 bytes (fp32 copy)      0 (the fp32 parameters are the master)
    optimizer states  8 bytes (Adam m and v)   8 bytes

so K = 12 bytes of optimizer state in mixed precision and 16 bytes per parameter in all
(the paper's 2 + 2 + 12; a 70B model needs 1.12 TB per rank under DDP). Each stage
partitions one more kind across the N ranks:

    stage 0 (DDP)   2Ψ + 2Ψ + 12Ψ
    stage 1         2Ψ + 2Ψ + 12Ψ/N        optimizer states (and master weights) sharded
    stage 2         2Ψ + (2 + 12)Ψ/N       + gradients sharded
    stage 3         (2 + 2 + 12)Ψ/N        + parameters sharded

Communication per step, as the paper counts it (elements moved per rank): DDP all-reduces
the gradients, which is a reduce-scatter plus an all-gather, 2Ψ. Stages 1 and 2 do the same
2Ψ as a reduce-scatter of gradients and an all-gather of the updated parameters. Stage 3
all-gathers the parameters twice (forward and backward) and reduce-scatters gradients: 3Ψ.

`comm_bytes_per_step` gives the same in nccl-tests "size" terms per collective op (the full
tensor: all-gather output, reduce-scatter input, all-reduce buffer), which is what the
engine's comm module reports per call; `comm_traffic_bytes` turns sizes into the bytes a
rank actually sends, size * busbw factor ((n-1)/n, or 2(n-1)/n for all-reduce).

CPU offload (ZeRO-Offload) moves the optimizer states, the fp32 master weights and an fp32
gradient partition to host memory (stages 1-3); parameter offload (stage 3) keeps the
parameter shard on the host too.

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Adam keeps two fp32 moments per parameter.
ADAM_STATE_BYTES = 8
MASTER_BYTES = 4


def shard(numel: int, world_size: int) -> int:
    """Elements of one rank's shard: ceil(numel / N) (the last shard is padded)."""
    return math.ceil(numel / max(world_size, 1))


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank model-state bytes by kind, split into device (GPU, or the training
    device) and host (CPU offload) memory. Keys are events.STATE_KINDS."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def total(self) -> int:
        return self.device_total + self.host_total

    def flat(self) -> dict[str, int]:
        """Device kinds as-is and host kinds as `host_<kind>`: the events.MemoryStats form."""
        out = dict(self.device)
        out.update({f"host_{k}": v for k, v in self.host.items() if v})
        return out


def model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    precision: str = "fp32",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    persistent_params: int = 0,
) -> ModelStateBytes:
    """Per-rank model-state bytes for a ZeRO stage (Adam / AdamW).

    Args:
        num_params: Ψ, trainable parameters of the model.
        world_size: N, data-parallel ranks.
        stage: ZeRO stage 0-3.
        precision: "fp32", "bf16" or "fp16" (the latter two keep fp32 master weights).
        offload_optimizer: optimizer states, master weights and the fp32 gradient partition
            live on the host (stages 1-3).
        offload_param: parameter shards live on the host (stage 3 only).
        persistent_params: stage 3 only: elements of small parameters kept whole on every
            rank (`stage3_param_persistence_threshold`), not sharded.

    Returns:
        The bytes per kind, on device and on host.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: expected 0, 1, 2 or 3, got {stage!r}")
    if precision not in PARAM_BYTES:
        raise ValueError(f"precision: expected one of {sorted(PARAM_BYTES)}, got {precision!r}")
    p = PARAM_BYTES[precision]
    mixed = precision != "fp32"
    n = max(world_size, 1)
    full, part = num_params, shard(num_params, n)
    if stage == 3 and persistent_params:
        # Persistent parameters are replicated: full size everywhere, sharded part smaller.
        sharded = num_params - persistent_params
        part_params = shard(sharded, n) + persistent_params
    else:
        part_params = part

    params = p * (part_params if stage >= 3 else full)
    grads = p * (part_params if stage >= 3 else part if stage >= 2 else full)
    opt_elems = full if stage == 0 else part
    if stage == 3 and persistent_params:
        # Persistent parameters are updated whole on every rank (their gradients are
        # all-reduced), so their optimizer state and master copy are whole too.
        opt_elems = part_params
    optimizer_states = ADAM_STATE_BYTES * opt_elems
    master = MASTER_BYTES * opt_elems if mixed else 0

    device = {"params": params, "grads": grads, "optimizer_states": optimizer_states,
              "master_weights": master}  # fmt: skip
    host = {"params": 0, "grads": 0, "optimizer_states": 0, "master_weights": 0}
    if offload_optimizer and stage >= 1:
        # The CPU step updates an fp32 copy of the shard and reads fp32 gradients there;
        # the device keeps its parameters and (stage 1: full, stage 2-3: sharded) gradients.
        host["optimizer_states"] = device["optimizer_states"]
        host["master_weights"] = MASTER_BYTES * opt_elems
        host["grads"] = 4 * opt_elems
        device["optimizer_states"] = 0
        device["master_weights"] = 0
    if offload_param and stage == 3:
        # Persistent parameters stay on the device (they are used whole every step).
        device["params"] = p * persistent_params
        host["params"] = params - device["params"]
        if not mixed and not offload_optimizer:
            # The host's fp32 parts cannot be the master the device's optimizer steps: a
            # device copy of the sharded part is.
            device["master_weights"] = MASTER_BYTES * (part_params - persistent_params)
    return ModelStateBytes(device=device, host=host)


def comm_bytes_per_step(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    precision: str = "fp32",
    gradient_accumulation_steps: int = 1,
    persistent_params: int = 0,
) -> dict[str, int]:
    """Collective sizes (nccl-tests "size", bytes) per optimizer step on one rank, by op.

    Stage 0 all-reduces gradients once per step. Stage 1 reduce-scatters the accumulated
    gradients once per step and all-gathers the updated parameters. Stage 2 holds only a
    gradient shard, so it reduce-scatters after every micro-batch. Stage 3 also all-gathers
    the parameters before the forward and again before the backward of every micro-batch;
    persistent (unsharded) parameters are all-reduced instead, once per step.

    With one rank nothing is communicated.
    """
    if world_size <= 1:
        return {}
    p = PARAM_BYTES[precision]
    ga = max(gradient_accumulation_steps, 1)
    if stage == 0:
        return {"all_reduce": p * num_params}
    if stage == 1:
        return {"reduce_scatter": p * num_params, "all_gather": p * num_params}
    if stage == 2:
        return {"reduce_scatter": ga * p * num_params, "all_gather": p * num_params}
    if stage == 3:
        sharded = num_params - persistent_params
        out = {"all_gather": 2 * ga * p * sharded, "reduce_scatter": ga * p * sharded}
        if persistent_params:
            # Whole on every rank: accumulated locally, all-reduced once per step.
            out["all_reduce"] = p * persistent_params
        return out
    raise ValueError(f"stage: expected 0, 1, 2 or 3, got {stage!r}")


def comm_traffic_bytes(sizes: dict[str, int], world_size: int) -> int:
    """Bytes one rank sends for these collective sizes (size * nccl-tests bus factor)."""
    n = max(world_size, 1)
    total = 0.0
    for op, size in sizes.items():
        factor = 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        total += size * factor
    return round(total)


def paper_comm_volume(num_params: int, stage: int) -> int:
    """Elements moved per rank per step as the ZeRO paper counts them: 2Ψ or 3Ψ."""
    return 3 * num_params if stage == 3 else 2 * num_params


__all__ = [
    "ADAM_STATE_BYTES",
    "PARAM_BYTES",
    "ModelStateBytes",
    "comm_bytes_per_step",
    "comm_traffic_bytes",
    "model_state_bytes",
    "paper_comm_volume",
    "shard",
]
