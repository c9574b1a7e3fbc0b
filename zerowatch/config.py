"""DeepSpeed-JSON config -> typed, validated dataclasses ("auto" resolved where it can be).

SKELETON: the field names below are the contract the engine reads. The parser
(`load_config`) is being completed: every DeepSpeed key listed in the engine issue, "auto"
resolution, did-you-mean, errors naming the key path.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config mistake; the message starts with the key path, e.g.
    `zero_optimization.offload_param.device: expected "cpu" or "none", got "nvme"`."""


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    device: str = "none"
    """"cpu" or "none"."""
    pin_memory: bool = False
    """Pinned host buffers for the copies (honoured where the device is a GPU)."""


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0
    """0 means dynamic loss scaling."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    type: str = "AdamW"
    """"Adam" or "AdamW" (case-insensitive in the JSON)."""
    params: dict[str, Any] = field(default_factory=dict)
    """lr, betas, eps, weight_decay (and Adam's adam_w_mode / torch_adam, accepted)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    type: str = "WarmupLR"
    """"WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"."""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ZeroWatchConfig:
    """The resolved config of one job."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    zero_allow_untested_optimizer: bool = False

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32"."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a DeepSpeed-style JSON dict (what a run records)."""
        from dataclasses import asdict

        return asdict(self)


def load_config(
    config: dict[str, Any] | str | Any,
    *,
    world_size: int = 1,
    hidden_size: int | None = None,
) -> ZeroWatchConfig:
    """Read a DeepSpeed config (dict, or path to a JSON file) into a ZeroWatchConfig.

    Args:
        config: the dict, or a path to a DeepSpeed JSON file.
        world_size: data-parallel size, to resolve batch sizes from each other.
        hidden_size: the model's hidden size, to resolve "auto" bucket sizes and thresholds
            the way DeepSpeed's HF integration does.

    Raises:
        ConfigError: naming the key path of the first mistake.
    """
    raise NotImplementedError("config parser is being written")


__all__ = [
    "BF16Config",
    "ConfigError",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroWatchConfig",
    "load_config",
]
