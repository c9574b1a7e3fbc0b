"""DeepSpeed-JSON config -> typed, validated dataclasses ("auto" resolved where it can be).

`load_config` reads a dict or a DeepSpeed JSON file once, at the edge, and returns a frozen
`ZeroWatchConfig`; the engine never looks at the raw JSON. What it does with each key is
decided by the tables in `zerowatch._config_keys` (honoured, ignored with a warning,
refused), which also generate docs/migrating-from-deepspeed.md.

Every mistake is a `ConfigError` whose message starts with the dotted key path, e.g.
`zero_optimization.offload_param.device: expected "cpu" or "none", got "nvme"`; a misspelt
key gets a did-you-mean. Integers may be written as whole floats (`2e8`), as DeepSpeed
configs often do.

"auto" (the HuggingFace-integration placeholder) is resolved where the information exists:
batch sizes from each other (train_batch_size = micro * accumulation * world size), bucket
sizes and the persistence threshold from the model's hidden size as HF does
(reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h², stage3_param_persistence_
threshold = 10·h; with no hidden size known, DeepSpeed's default for the key and a
ConfigWarning naming the key and the value taken), a scheduler's warmup_max_lr from the
optimizer's lr. Anywhere else it is an error naming the key.

Standard library only.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from zerowatch import _config_keys as keys

AUTO = "auto"


class ConfigError(ValueError):
    """A config mistake; the message starts with the key path, e.g.
    `zero_optimization.offload_param.device: expected "cpu" or "none", got "nvme"`."""


class ConfigWarning(UserWarning):
    """A config key that zerowatch ignores because ignoring it is harmless."""


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    device: str = "none"
    """"cpu" or "none"."""
    pin_memory: bool = False
    """Pinned host buffers for the copies (honoured where the device is a GPU)."""

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    """Elements (not bytes) per gradient-reduction bucket."""
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    """Elements per parameter all-gather bucket (stages 1-2)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    enabled: bool = False
    auto_cast: bool = False
    """Cast floating-point forward inputs to fp16 (DeepSpeed's `auto_cast`)."""
    loss_scale: float = 0.0
    """0 means dynamic loss scaling."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    type: str = "AdamW"
    """"Adam" or "AdamW" (case-insensitive in the JSON, normalised here)."""
    params: dict[str, Any] = field(default_factory=dict)
    """lr, betas, eps, weight_decay (DeepSpeed's defaults filled in), adam_w_mode, and
    torch_adam when given."""

    @property
    def adam_w_mode(self) -> bool:
        """Decoupled weight decay (AdamW). DeepSpeed's "Adam" means AdamW unless
        `adam_w_mode` is false, so this is what the engine must build."""
        return self.type == "AdamW" or bool(self.params.get("adam_w_mode", True))


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    type: str = "WarmupLR"
    """"WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"."""
    params: dict[str, Any] = field(default_factory=dict)
    """Every parameter of that scheduler under DeepSpeed's name, defaults filled in."""


@dataclass(frozen=True, kw_only=True)
class ZeroWatchConfig:
    """The resolved config of one job."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    gradient_predivide_factor: float = 1.0
    """Gradients are multiplied by 1/f before the sum across ranks and by f/N after (N the
    world size); 1 (DeepSpeed's default) divides by N before the sum, as DeepSpeed's
    reduce-scatter path does, so that fp16 sums cannot grow with N."""
    prescale_gradients: bool = False
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
        """ "fp16", "bf16" or "fp32"."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a DeepSpeed-style JSON dict (what a run records); it
        loads back into an equal config."""
        return asdict(self)


# Scheduler parameters by type: name -> default (REQUIRED: no default).
REQUIRED = object()
_WARMUP = {"warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}
SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, **_WARMUP},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, **_WARMUP,
                      "total_num_steps": REQUIRED},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0,
                       "cos_min_ratio": 0.0001, **_WARMUP},
}  # fmt: skip
OPTIMIZER_TYPES = ("Adam", "AdamW")


def read_config_source(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The raw config dict from a dict or a path to a JSON file (ConfigError otherwise)."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"config: expected a dict or a path to a JSON file, got {type(config).__name__}"
        )
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: file not found: {os.fspath(config)}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config: {os.fspath(config)} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {os.fspath(config)} must hold a JSON object")
    return raw


def load_config(
    config: ZeroWatchConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    world_size: int = 1,
    hidden_size: int | None = None,
) -> ZeroWatchConfig:
    """Read a DeepSpeed config (dict, or path to a JSON file) into a ZeroWatchConfig.

    Args:
        config: the dict, or a path to a DeepSpeed JSON file (a ZeroWatchConfig is
            returned as it is).
        world_size: data-parallel size, to resolve batch sizes from each other.
        hidden_size: the model's hidden size, to resolve "auto" bucket sizes and thresholds
            the way DeepSpeed's HF integration does.

    Returns:
        The validated config with every default and "auto" filled in.

    Raises:
        ConfigError: naming the key path of the first mistake.
    """
    if isinstance(config, ZeroWatchConfig):
        return config
    top = _Section(read_config_source(config), "")
    zero = _read_zero(top.section("zero_optimization"), hidden_size)
    fp16 = _read_fp16(top.section("fp16"))
    bf16 = BF16Config(enabled=top.section("bf16").boolean("enabled", False))
    if fp16.enabled and bf16.enabled:
        raise ConfigError("fp16.enabled: fp16 and bf16 cannot both be enabled")
    optimizer = _read_optimizer(top.section("optimizer")) if top.given("optimizer") else None
    scheduler = (
        _read_scheduler(top.section("scheduler"), optimizer) if top.given("scheduler") else None
    )
    train, micro, accum = _resolve_batch(top, world_size)
    return ZeroWatchConfig(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        gradient_clipping=top.number("gradient_clipping", 0.0, min=0.0),
        gradient_predivide_factor=top.number(
            "gradient_predivide_factor", 1.0, min=0.0, exclusive=True
        ),
        prescale_gradients=top.boolean("prescale_gradients", False),
        zero_optimization=zero,
        fp16=fp16,
        bf16=bf16,
        optimizer=optimizer,
        scheduler=scheduler,
        steps_per_print=top.integer("steps_per_print", 10, min=1),
        wall_clock_breakdown=top.boolean("wall_clock_breakdown", False),
        zero_allow_untested_optimizer=top.boolean("zero_allow_untested_optimizer", False),
    )


def _read_zero(z: _Section, hidden_size: int | None) -> ZeroConfig:
    stage = z.integer("stage", 0, min=0, max=3)
    legacy_pin = z.boolean("cpu_offload_use_pin_memory", False)
    offload_opt = _read_offload(z, "offload_optimizer", "cpu_offload", legacy_pin)
    offload_param = _read_offload(z, "offload_param", "cpu_offload_param", legacy_pin)
    if offload_opt.enabled and stage == 0:
        raise ConfigError(f"{z.key('offload_optimizer')}: needs stage 1, 2 or 3, not 0")
    if offload_param.enabled and stage != 3:
        raise ConfigError(f"{z.key('offload_param')}: needs stage 3, not {stage}")
    h = hidden_size
    # Without the hidden size, "auto" takes DeepSpeed's own default for the key (with a
    # warning naming it): a config written for the HF integration still loads.
    unknown_h = "the model's hidden size is not known"
    return ZeroConfig(
        stage=stage,
        offload_optimizer=offload_opt,
        offload_param=offload_param,
        overlap_comm=z.boolean("overlap_comm", False),
        contiguous_gradients=z.boolean("contiguous_gradients", True),
        reduce_scatter=z.boolean("reduce_scatter", True),
        reduce_bucket_size=z.integer("reduce_bucket_size", 500_000_000, min=1,
                                 auto=h * h if h else None, auto_default=unknown_h),
        allgather_partitions=z.boolean("allgather_partitions", True),
        allgather_bucket_size=z.integer("allgather_bucket_size", 500_000_000, min=1),
        stage3_prefetch_bucket_size=z.integer("stage3_prefetch_bucket_size", 50_000_000, min=0,
                                          auto=int(0.9 * h * h) if h else None,
                                          auto_default=unknown_h),
        stage3_param_persistence_threshold=z.integer("stage3_param_persistence_threshold", 100_000,
                                                 min=0, auto=10 * h if h else None,
                                                 auto_default=unknown_h),
        stage3_max_live_parameters=z.integer("stage3_max_live_parameters", 1_000_000_000, min=0),
        stage3_max_reuse_distance=z.integer("stage3_max_reuse_distance", 1_000_000_000, min=0),
        sub_group_size=z.integer("sub_group_size", 1_000_000_000, min=1),
        stage3_gather_16bit_weights_on_model_save=z.boolean(
            "stage3_gather_16bit_weights_on_model_save", False),
    )  # fmt: skip


def _read_offload(z: _Section, name: str, legacy: str, legacy_pin: bool) -> OffloadConfig:
    """`offload_optimizer` / `offload_param`, or their deprecated boolean form."""
    if z.given(legacy):
        if z.given(name):
            raise ConfigError(f"{z.key(legacy)}: deprecated alias of {name}; give only one")
        _warn(f'{z.key(legacy)}: deprecated, write "{name}": {{"device": "cpu"}}')
        on = z.boolean(legacy, False)
        return OffloadConfig(device="cpu" if on else "none", pin_memory=legacy_pin)
    s = z.section(name)
    device = s.get("device", "none")
    if device is None:
        device = "none"
    if device not in ("cpu", "none"):
        hint = " (NVMe offload is not supported)" if device == "nvme" else ""
        raise ConfigError(f'{s.key("device")}: expected "cpu" or "none", got {_show(device)}{hint}')
    return OffloadConfig(device=device, pin_memory=s.boolean("pin_memory", legacy_pin))


def _read_fp16(s: _Section) -> FP16Config:
    return FP16Config(
        enabled=s.boolean("enabled", False),
        auto_cast=s.boolean("auto_cast", False),
        loss_scale=s.number("loss_scale", 0.0, min=0.0),
        initial_scale_power=s.integer("initial_scale_power", 16, min=0, max=127),
        loss_scale_window=s.integer("loss_scale_window", 1000, min=1),
        hysteresis=s.integer("hysteresis", 2, min=1),
        consecutive_hysteresis=s.boolean("consecutive_hysteresis", False),
        min_loss_scale=s.number("min_loss_scale", 1.0, min=0.0, exclusive=True),
    )


def _read_optimizer(s: _Section) -> OptimizerConfig:
    if not s.given("type"):
        raise ConfigError(f'{s.key("type")}: required ("Adam" or "AdamW")')
    name = s.get("type")
    match = {t.lower(): t for t in OPTIMIZER_TYPES}.get(str(name).lower())
    if not isinstance(name, str) or match is None:
        raise ConfigError(
            f'{s.key("type")}: expected "Adam" or "AdamW", got {_show(name)} (zerowatch '
            "implements only Adam and AdamW; zero_allow_untested_optimizer does not change that)"
        )
    p = s.section("params")
    params: dict[str, Any] = {
        "lr": p.number("lr", 1e-3, min=0.0, exclusive=True),
        "betas": _betas(p),
        "eps": p.number("eps", 1e-8, min=0.0, exclusive=True),
        "weight_decay": p.number("weight_decay", 0.0, min=0.0),
        "adam_w_mode": p.boolean("adam_w_mode", True),
    }
    if p.given("torch_adam"):
        params["torch_adam"] = p.boolean("torch_adam", False)
    if not p.boolean("bias_correction", True):
        raise ConfigError(f"{p.key('bias_correction')}: only true is supported")
    if p.boolean("amsgrad", False):
        raise ConfigError(f"{p.key('amsgrad')}: only false is supported")
    return OptimizerConfig(type=match, params=params)


def _betas(p: _Section) -> tuple[float, float]:
    value = p.get("betas", [0.9, 0.999])
    key = p.key("betas")
    if value == AUTO:
        raise ConfigError(f'{key}: "auto" cannot be resolved here (write [beta1, beta2])')
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(_is_number(b) and 0.0 <= b < 1.0 for b in value):
        raise ConfigError(f"{key}: expected [beta1, beta2] with each in [0, 1), got {_show(value)}")
    return (float(value[0]), float(value[1]))


def _read_scheduler(s: _Section, optimizer: OptimizerConfig | None) -> SchedulerConfig:
    name = s.get("type")
    match = {t.lower(): t for t in SCHEDULER_PARAMS}.get(str(name).lower())
    if not isinstance(name, str) or match is None:
        raise ConfigError(
            f"{s.key('type')}: expected one of {', '.join(SCHEDULER_PARAMS)}, got {_show(name)}"
        )
    spec = SCHEDULER_PARAMS[match]
    p = s.section("params", known=set(spec), known_for=match)
    lr = optimizer.params["lr"] if optimizer else None
    params: dict[str, Any] = {}
    for k, default in spec.items():
        if default is REQUIRED and not p.given(k):
            raise ConfigError(f"{p.key(k)}: required by {match}")
        if k == "warmup_type":
            params[k] = p.choice(k, default, ("log", "linear"))
        elif isinstance(default, float):
            auto = 0.0 if k == "warmup_min_lr" else lr if k == "warmup_max_lr" else None
            why = "give the optimizer a numeric lr" if k == "warmup_max_lr" else ""
            if k.endswith("_lr") and isinstance(p.get(k), list):  # one per param group
                params[k] = _lr_list(p.key(k), p.get(k))
            else:
                params[k] = p.number(k, default, min=0.0, auto=auto, why=why)
        else:
            lo = -1 if k == "last_batch_iteration" else 1 if k == "total_num_steps" else 0
            params[k] = p.integer(k, default if isinstance(default, int) else 0, min=lo)
    if "total_num_steps" in params and params["total_num_steps"] < params["warmup_num_steps"]:
        raise ConfigError(
            f"{p.key('total_num_steps')}: {params['total_num_steps']} is less than "
            f"warmup_num_steps {params['warmup_num_steps']}"
        )
    return SchedulerConfig(type=match, params=params)


def _lr_list(key: str, value: list[Any]) -> list[float]:
    if not value or not all(_is_number(v) and v >= 0 for v in value):
        raise ConfigError(f"{key}: expected a number >= 0 or a list of them, got {_show(value)}")
    return [float(v) for v in value]


_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _resolve_batch(top: _Section, world_size: int) -> tuple[int | None, int | None, int]:
    """train_batch_size = micro * gradient_accumulation_steps * world_size, as DeepSpeed
    resolves it: any two give the third, one of the batch sizes alone implies accumulation 1.
    "auto" counts as not given."""
    if world_size < 1:
        raise ConfigError(f"world_size: expected >= 1, got {world_size}")
    tb, mb, ga = (top.integer(k, None, min=1, auto=-1) for k in _BATCH)
    tb, mb, ga = (None if v == -1 else v for v in (tb, mb, ga))
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * world_size:
            raise ConfigError(
                f"train_batch_size: {tb} != train_micro_batch_size_per_gpu {mb} * "
                f"gradient_accumulation_steps {ga} * world size {world_size} = "
                f"{mb * ga * world_size}"
            )
    elif tb is not None and mb is not None:
        ga = _divide(tb, mb * world_size, "gradient_accumulation_steps",
                     f"train_batch_size {tb} / (train_micro_batch_size_per_gpu {mb} * world size {world_size})")  # fmt: skip
    elif tb is not None:
        ga = ga or 1
        mb = _divide(tb, ga * world_size, "train_micro_batch_size_per_gpu",
                     f"train_batch_size {tb} / (gradient_accumulation_steps {ga} * world size {world_size})")  # fmt: skip
    elif mb is not None:
        ga = ga or 1
        tb = mb * ga * world_size
    return tb, mb, ga or 1


def _divide(a: int, b: int, key: str, expr: str) -> int:
    if a % b:
        raise ConfigError(f"{key}: {expr} is not a whole number")
    return a // b


class _Section:
    """One JSON object of the config, checked key by key against the tables on entry
    (aliases renamed, ignored keys warned about and dropped, refused keys rejected, unknown
    keys rejected with a did-you-mean), then read through typed getters whose errors start
    with the key path."""

    def __init__(
        self, raw: Any, path: str, *, known: set[str] | None = None, known_for: str = ""
    ) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path}: expected an object, got {_show(raw)}")
        self.path = path
        self.raw: dict[str, Any] = {}
        table = keys.section_keys(path)
        for name, value in raw.items():
            full = self.key(name)
            kind = table.get(name)
            if known is not None and kind == "honoured" and name not in known:
                kind = None
            if kind == "alias":
                canonical = keys.ALIASES[full].rpartition(".")[2]
                if canonical in raw:
                    raise ConfigError(f"{full}: another name for {canonical}; give only one")
                self.raw[canonical] = value
            elif kind == "honoured":
                self.raw[name] = value
            elif kind == "ignored":
                if not keys.is_off(value, (False, None)):  # no noise about what is off anyway
                    _warn(f"{full}: ignored ({keys.IGNORED[full]})")
            elif kind == "refused":
                refused = keys.REFUSED[full]
                if not keys.is_off(value, refused.off):
                    raise ConfigError(f"{full}: not supported ({refused.reason})")
            else:
                raise ConfigError(_unknown(full, name, known or set(table), known_for))

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def given(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name)
        return default if value is None else value

    def section(self, name: str, **kw: Any) -> _Section:
        return _Section(self.raw.get(name), self.key(name), **kw)

    def _auto(self, name: str, auto: Any, why: str) -> Any:
        if auto is None:
            hint = f" ({why})" if why else ""
            raise ConfigError(f'{self.key(name)}: "auto" cannot be resolved here{hint}')
        return auto

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if value == AUTO:
            self._auto(name, None, "write true or false")
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: expected true or false, got {_show(value)}")
        return value

    def integer(self, name: str, default: Any, *, min: int | None = None, max: int | None = None,
            auto: int | None = None, why: str = "", auto_default: str = "") -> Any:  # fmt: skip
        """`auto_default`: when "auto" has no value (`auto` None), why not; the key then
        takes `default` (DeepSpeed's) with a warning naming the key and the value taken."""
        value = self.get(name, default)
        if value == AUTO:
            if auto is None and auto_default:
                _warn(f'{self.key(name)}: "auto" cannot be resolved here ({auto_default}); '
                      f"took DeepSpeed's default {default}")  # fmt: skip
                return default
            return self._auto(name, auto, why)
        if value is None:
            return None
        if not _is_number(value) or not float(value).is_integer():
            raise ConfigError(f"{self.key(name)}: expected an integer, got {_show(value)}")
        return _in_range(self.key(name), int(value), min, max)

    def number(self, name: str, default: float, *, min: float | None = None,
              exclusive: bool = False, auto: float | None = None, why: str = "") -> float:  # fmt: skip
        value = self.get(name, default)
        if value == AUTO:
            return float(self._auto(name, auto, why))
        if not _is_number(value) or not math.isfinite(value):
            raise ConfigError(f"{self.key(name)}: expected a number, got {_show(value)}")
        if min is not None and exclusive and value <= min:
            raise ConfigError(f"{self.key(name)}: expected > {min:g}, got {value:g}")
        return float(_in_range(self.key(name), value, min, None))

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.get(name, default)
        if value not in choices:
            expected = " or ".join(f'"{c}"' for c in choices)
            raise ConfigError(f"{self.key(name)}: expected {expected}, got {_show(value)}")
        return str(value)


def _unknown(full: str, name: str, candidates: set[str], known_for: str) -> str:
    if known_for and full in keys.HONOURED:
        return f"{full}: not a parameter of {known_for} (its parameters: {', '.join(sorted(candidates))})"
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    if close:
        return f'{full}: unknown key; did you mean "{close[0]}"?'
    listed = f"known here: {', '.join(sorted(candidates))}; " if len(candidates) <= 12 else ""
    return f"{full}: unknown key ({listed}see docs/migrating-from-deepspeed.md)"


def _warn(message: str) -> None:
    """warnings.warn pointing at the first caller outside this module."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, ConfigWarning, stacklevel=level)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_range(key: str, value: Any, lo: Any, hi: Any) -> Any:
    if lo is not None and value < lo:
        raise ConfigError(f"{key}: expected >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: expected <= {hi}, got {value}")
    return value


def _show(value: Any) -> str:
    """A value as it reads in JSON ("nvme", 3.5, true, null)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


__all__ = [
    "BF16Config",
    "ConfigError",
    "ConfigWarning",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroWatchConfig",
    "load_config",
    "read_config_source",
]
