"""DeepSpeed config parsing: every key the engine honours, "auto", and every mistake named."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

import zerowatch
from zerowatch.config import ConfigError, ConfigWarning, load_config

HF_STAGE3 = {
    "fp16": {"enabled": False},
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": 10,
            "total_num_steps": 100,
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}


def test_every_listed_zero_key_is_read_into_the_dataclasses() -> None:
    raw = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "steps_per_print": 7,
        "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": False,
            "reduce_scatter": False,
            "reduce_bucket_size": 2e8,
            "allgather_partitions": False,
            "allgather_bucket_size": 3e8,
            "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 2e9,
            "stage3_max_reuse_distance": 3e9,
            "sub_group_size": 1e8,
            "stage3_gather_fp16_weights_on_model_save": True,
        },
        "fp16": {"enabled": True, "auto_cast": True, "loss_scale": 0, "initial_scale_power": 12,
                 "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5},
        "bf16": {"enabled": False},
        "optimizer": {"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True}},
        "scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 5, "warmup_type": "linear"}},
    }  # fmt: skip
    cfg = load_config(raw, world_size=2)
    z = cfg.zero_optimization
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (32, 4, 4)
    assert (cfg.gradient_clipping, cfg.steps_per_print, cfg.wall_clock_breakdown) == (0.5, 7, True)
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "none"
    assert (z.overlap_comm, z.contiguous_gradients, z.reduce_scatter, z.allgather_partitions) == (
        True,
        False,
        False,
        False,
    )
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (200_000_000, 300_000_000)
    assert isinstance(z.reduce_bucket_size, int)
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        10_000_000,
        10_000,
    )
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance, z.sub_group_size) == (
        2 * 10**9,
        3 * 10**9,
        10**8,
    )
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.precision == "fp16"
    assert cfg.fp16.auto_cast and cfg.fp16.consecutive_hysteresis
    assert (
        cfg.fp16.initial_scale_power,
        cfg.fp16.loss_scale_window,
        cfg.fp16.hysteresis,
        cfg.fp16.min_loss_scale,
    ) == (12, 500, 3, 0.5)
    assert (
        cfg.optimizer is not None and cfg.optimizer.type == "Adam" and not cfg.optimizer.adam_w_mode
    )
    assert cfg.optimizer.params == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                    "adam_w_mode": False, "torch_adam": True}  # fmt: skip
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 5,
                                    "warmup_type": "linear", "last_batch_iteration": -1}  # fmt: skip


def test_defaults_are_deepspeeds() -> None:
    cfg = load_config({})
    z = cfg.zero_optimization
    assert (
        z.stage == 0 and cfg.precision == "fp32" and cfg.optimizer is None and cfg.scheduler is None
    )
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.stage3_prefetch_bucket_size) == (
        5e8,
        5e8,
        5e7,
    )
    assert (z.stage3_param_persistence_threshold, z.stage3_max_live_parameters) == (1e5, 1e9)
    assert cfg.gradient_accumulation_steps == 1 and cfg.train_batch_size is None


def test_deepspeed_adam_means_adamw_unless_adam_w_mode_is_false() -> None:
    adam = load_config({"optimizer": {"type": "Adam", "params": {"lr": 0.1}}}).optimizer
    assert adam is not None and adam.adam_w_mode
    adamw = load_config({"optimizer": {"type": "ADAMW"}}).optimizer
    assert adamw is not None and adamw.type == "AdamW" and adamw.adam_w_mode


def test_huggingface_auto_values_resolve_from_hidden_size_and_batch_sizes() -> None:
    cfg = load_config(HF_STAGE3, world_size=4, hidden_size=1024)
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 1024 * 1024
    assert z.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert z.stage3_param_persistence_threshold == 10 * 1024
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (16, 4, 1)
    assert cfg.scheduler is not None
    assert (
        cfg.scheduler.params["warmup_max_lr"] == 3e-4
        and cfg.scheduler.params["warmup_min_lr"] == 0.0
    )
    assert cfg.precision == "bf16"


@pytest.mark.parametrize(
    ("key", "deepspeed_default"),
    [
        ("reduce_bucket_size", 500_000_000),
        ("stage3_prefetch_bucket_size", 50_000_000),
        ("stage3_param_persistence_threshold", 100_000),
    ],
)
def test_auto_without_hidden_size_takes_deepspeeds_default_and_warns(
    key: str, deepspeed_default: int
) -> None:
    given = {"zero_optimization": {"stage": 3, key: "auto"}}
    with pytest.warns(ConfigWarning) as caught:
        cfg = load_config(given)
    assert getattr(cfg.zero_optimization, key) == deepspeed_default
    messages = [str(w.message) for w in caught]
    assert messages == [
        f'zero_optimization.{key}: "auto" cannot be resolved here (the model\'s hidden size '
        f"is not known); took DeepSpeed's default {deepspeed_default}"
    ]
    # With a hidden size, "auto" is resolved from it and nothing is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = load_config(given, hidden_size=64)
    assert getattr(resolved.zero_optimization, key) != deepspeed_default


def test_initialize_takes_an_hf_auto_config_on_a_module_without_a_hidden_size() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    with pytest.warns(ConfigWarning, match=r"^zero_optimization.reduce_bucket_size: .*500000000"):
        engine, *_ = zerowatch.initialize(model=model, config=config)
    assert engine.config.zero_optimization.reduce_bucket_size == 500_000_000
    engine.destroy()


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),
        ({"train_batch_size": 8}, 4, (8, 2, 1)),
        ({"train_micro_batch_size_per_gpu": 5}, 2, (10, 5, 1)),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3}, 2, (None, None, 3)),
    ],
)  # fmt: skip
def test_batch_sizes_resolve_from_each_other(
    given: dict[str, Any], world_size: int, expected: tuple[Any, ...]
) -> None:
    cfg = load_config(given, world_size=world_size)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


def test_config_reads_from_a_json_file_path(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_STAGE3))
    from_path = load_config(path, world_size=4, hidden_size=64)
    from_str = load_config(str(path), world_size=4, hidden_size=64)
    assert from_path == from_str == load_config(HF_STAGE3, world_size=4, hidden_size=64)
    assert from_path.zero_optimization.stage == 3


def test_whole_floats_are_accepted_for_integer_keys() -> None:
    z = load_config(
        {"zero_optimization": {"stage": 2.0, "reduce_bucket_size": 2e8}}
    ).zero_optimization
    assert (
        z.stage == 2 and z.reduce_bucket_size == 200_000_000 and type(z.reduce_bucket_size) is int
    )


def test_resolved_config_round_trips_through_to_dict() -> None:
    cfg = load_config(HF_STAGE3, world_size=4, hidden_size=256)
    d = cfg.to_dict()
    assert json.loads(json.dumps(d))["zero_optimization"]["reduce_bucket_size"] == 256 * 256
    assert load_config(d, world_size=4) == cfg


def test_config_error_is_a_value_error_exported_at_the_top() -> None:
    assert zerowatch.ConfigError is ConfigError and issubclass(ConfigError, ValueError)


MISTAKES: list[tuple[str, dict[str, Any], str]] = [
    ("nvme param offload", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     'zero_optimization.offload_param.device: expected "cpu" or "none", got "nvme"'),
    ("nvme optimizer offload", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     'zero_optimization.offload_optimizer.device: expected "cpu" or "none", got "nvme"'),
    ("param offload below stage 3", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param: needs stage 3"),
    ("optimizer offload at stage 0", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: needs stage 1, 2 or 3"),
    ("stage out of range", {"zero_optimization": {"stage": 4}}, "zero_optimization.stage: expected <= 3"),
    ("negative stage", {"zero_optimization": {"stage": -1}}, "zero_optimization.stage: expected >= 0"),
    ("fractional integer", {"zero_optimization": {"reduce_bucket_size": 2.5e0}}, "zero_optimization.reduce_bucket_size: expected an integer"),
    ("string integer", {"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage: expected an integer, got "2"'),
    ("bool for integer", {"gradient_accumulation_steps": True}, "gradient_accumulation_steps: expected an integer"),
    ("integer for bool", {"zero_optimization": {"overlap_comm": 1}}, "zero_optimization.overlap_comm: expected true or false"),
    ("section not an object", {"zero_optimization": 3}, "zero_optimization: expected an object, got 3"),
    ("fp16 and bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled: fp16 and bf16 cannot both be enabled"),
    ("bf16 alias and fp16", {"fp16": {"enabled": True}, "bfloat16": {"enabled": True}}, "fp16.enabled: fp16 and bf16"),
    ("alias given twice", {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16: another name for bf16"),
    ("zero alias given twice", {"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 1}},
     "zero_optimization.prefetch_bucket_size: another name for stage3_prefetch_bucket_size"),
    ("negative clipping", {"gradient_clipping": -1.0}, "gradient_clipping: expected >= 0"),
    ("min loss scale zero", {"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale: expected > 0"),
    ("loss scale window zero", {"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window: expected >= 1"),
    ("untested optimizer", {"optimizer": {"type": "Lamb"}}, 'optimizer.type: expected "Adam" or "AdamW", got "Lamb"'),
    ("untested optimizer even when allowed", {"zero_allow_untested_optimizer": True, "optimizer": {"type": "OneBitAdam"}},
     'optimizer.type: expected "Adam" or "AdamW", got "OneBitAdam"'),
    ("optimizer without type", {"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type: required"),
    ("negative lr", {"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr: expected > 0"),
    ("bad betas", {"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas: expected [beta1, beta2]"),
    ("amsgrad", {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad: only false"),
    ("no bias correction", {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction: only true"),
    ("unknown optimizer param", {"optimizer": {"type": "Adam", "params": {"weight_decai": 0.1}}},
     'optimizer.params.weight_decai: unknown key; did you mean "weight_decay"?'),
    ("unknown scheduler", {"scheduler": {"type": "OneCycle"}}, 'scheduler.type: expected one of WarmupLR, WarmupDecayLR, WarmupCosineLR, got "OneCycle"'),
    ("missing total_num_steps", {"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps: required by WarmupDecayLR"),
    ("cosine without total", {"scheduler": {"type": "WarmupCosineLR"}}, "scheduler.params.total_num_steps: required by WarmupCosineLR"),
    ("param of another scheduler", {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1}}},
     "scheduler.params.warmup_max_lr: not a parameter of WarmupCosineLR"),
    ("misspelt scheduler param", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 9}}},
     'scheduler.params.warmup_num_step: unknown key; did you mean "warmup_num_steps"?'),
    ("bad warmup type", {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
     'scheduler.params.warmup_type: expected "log" or "linear", got "cosine"'),
    ("total below warmup", {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}},
     "scheduler.params.total_num_steps: 5 is less than warmup_num_steps 10"),
    ("batch mismatch", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size: 10 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 2 * world size 2 = 8"),
    ("batch not divisible", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     "gradient_accumulation_steps: train_batch_size 10 / (train_micro_batch_size_per_gpu 4 * world size 2) is not a whole number"),
    ("zero micro batch", {"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu: expected >= 1"),
    ("auto allgather bucket", {"zero_optimization": {"allgather_bucket_size": "auto"}},
     'zero_optimization.allgather_bucket_size: "auto" cannot be resolved'),
    ("auto lr", {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, 'optimizer.params.lr: "auto" cannot be resolved'),
    ("auto warmup max lr without optimizer", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
     'scheduler.params.warmup_max_lr: "auto" cannot be resolved here (give the optimizer a numeric lr)'),
    ("auto clipping", {"gradient_clipping": "auto"}, 'gradient_clipping: "auto" cannot be resolved'),
    ("auto fp16", {"fp16": {"enabled": "auto"}}, 'fp16.enabled: "auto" cannot be resolved'),
    ("auto stage", {"zero_optimization": {"stage": "auto"}}, 'zero_optimization.stage: "auto" cannot be resolved'),
    ("misspelt top-level key", {"gradient_clippin": 1.0}, 'gradient_clippin: unknown key; did you mean "gradient_clipping"?'),
    ("misspelt zero key", {"zero_optimization": {"stage3_prefetch_bucket_sise": 1}},
     'zero_optimization.stage3_prefetch_bucket_sise: unknown key; did you mean "stage3_prefetch_bucket_size"?'),
    ("misspelt offload key", {"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}},
     'zero_optimization.offload_param.devise: unknown key; did you mean "device"?'),
    ("unknown key", {"frobnicate": 1}, "frobnicate: unknown key"),
    ("ZeRO++ weights", {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights: not supported"),
    ("ZeRO++ gradients", {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
     "zero_optimization.zero_quantized_gradients: not supported"),
    ("ZeRO++ hpZ", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size: not supported"),
    ("pipeline parallel", {"pipeline": {"stages": 2}}, "pipeline: not supported (pipeline parallelism"),
    ("tensor parallel", {"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel: not supported"),
    ("partial offload", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio: not supported"),
    ("fp16 master weights", {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads: not supported"),
    ("communication dtype", {"communication_data_type": "fp32"}, "communication_data_type: not supported"),
    ("legacy and new offload", {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload: deprecated alias of offload_optimizer; give only one"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "message"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES]
)
def test_each_mistake_gives_an_error_starting_with_its_key_path(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=2)
    assert str(info.value).startswith(message), str(info.value)


def test_refused_keys_set_to_off_are_accepted_silently() -> None:
    raw = {
        "zero_optimization": {"stage": 3, "zero_quantized_weights": False, "zero_hpz_partition_size": 1, "mics_shard_size": -1},
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "elasticity": {"enabled": False, "max_train_batch_size": 2000},
        "communication_data_type": None,
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(raw).zero_optimization.stage == 3


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"tensorboard": {"enabled": True, "output_path": "logs/"}}, "tensorboard"),
        ({"comms_logger": {"enabled": True}}, "comms_logger"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
        ({"wandb": {"enabled": True}}, "wandb"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/local_nvme"}}},
         "zero_optimization.offload_param.nvme_path"),
        ({"zero_optimization": {"stage": 2, "round_robin_gradients": True}}, "zero_optimization.round_robin_gradients"),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ],
)  # fmt: skip
def test_harmless_keys_are_ignored_with_a_warning_naming_them(
    raw: dict[str, Any], key: str
) -> None:
    with pytest.warns(ConfigWarning, match=rf"^{key}: ignored"):
        load_config(raw)


def test_deprecated_cpu_offload_means_optimizer_offload_and_warns() -> None:
    with pytest.warns(ConfigWarning, match=r"^zero_optimization.cpu_offload: deprecated"):
        z = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert z.offload_optimizer.device == "cpu"


def test_other_deepspeed_names_are_accepted() -> None:
    raw = {
        "bfloat16": {"enabled": True},
        "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "param_persistence_threshold": 8,
                              "max_live_parameters": 9, "max_reuse_distance": 10, "gather_16bit_weights_on_model_save": True},
    }  # fmt: skip
    cfg = load_config(raw)
    z = cfg.zero_optimization
    assert cfg.precision == "bf16"
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (7, 8)
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (9, 10)
    assert z.stage3_gather_16bit_weights_on_model_save


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/nonexistent/ds.json", "config: file not found: /nonexistent/ds.json"),
        (42, "config: expected a dict or a path to a JSON file, got int"),
    ],
)
def test_a_bad_source_is_a_config_error(source: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config(source)


def test_a_file_that_is_not_json_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(ConfigError, match=r"^config: .*ds.json is not valid JSON: .*line 1"):
        load_config(path)


# ---- the key tables, and the migration guide generated from them ---------------------------

from zerowatch import _config_keys as keys  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-deepspeed.md"


def nested(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def test_migration_guide_tables_are_the_parsers_tables() -> None:
    text = DOC.read_text()
    start, end = text.index("<!-- keys:start -->\n"), text.index("<!-- keys:end -->")
    assert text[start + len("<!-- keys:start -->\n") : end] == keys.markdown_tables(), (
        "regenerate the tables with `python -m zerowatch._config_keys`"
    )


def test_every_key_in_the_guide_is_known_to_the_parser() -> None:
    import re

    text = DOC.read_text()
    tables = text[text.index("<!-- keys:start -->") :]
    listed = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", tables, flags=re.M))
    known = set(keys.HONOURED) | set(keys.ALIASES) | set(keys.IGNORED) | set(keys.REFUSED)
    assert listed == known


@pytest.mark.parametrize("path", sorted(keys.REFUSED))
def test_every_refused_key_turned_on_is_an_error_naming_it(path: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re_escape(path)}: not supported \("):
        load_config(nested(path, True))


@pytest.mark.parametrize("path", sorted(keys.IGNORED))
def test_every_ignored_key_warns_naming_it(path: str) -> None:
    raw = nested(path, True)
    if path.startswith("optimizer."):
        raw["optimizer"]["type"] = "AdamW"
    with pytest.warns(ConfigWarning, match=rf"^{re_escape(path)}: ignored \("):
        load_config(raw)


@pytest.mark.parametrize("path", sorted(keys.ALIASES))
def test_every_alias_lands_on_its_key(path: str) -> None:
    value: Any = (
        {"enabled": True}
        if path == "bfloat16"
        else 12345
        if "size" in path or "param" in path or "distance" in path
        else True
    )
    via_alias = load_config(nested(path, value))
    direct = load_config(nested(keys.ALIASES[path], value))
    assert via_alias == direct != load_config({})


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_scheduler_lrs_may_be_given_per_param_group() -> None:
    cfg = load_config(
        {
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": [0, 0.1], "warmup_max_lr": [1e-3, 2e-3]},
            }
        }
    )
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_max_lr"] == [1e-3, 2e-3]
    with pytest.raises(
        ConfigError, match=r"^scheduler.params.warmup_min_lr: expected a number >= 0 or a list"
    ):
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [-1]}}})


def test_ignored_keys_that_are_off_do_not_warn() -> None:
    raw = {
        "tensorboard": {"enabled": False, "output_path": "x"},
        "zero_force_ds_cpu_optimizer": False,
        "comms_logger": None,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(raw)


def test_a_loaded_config_passes_through() -> None:
    cfg = load_config({"zero_optimization": {"stage": 1}})
    assert load_config(cfg) is cfg
