"""Every DeepSpeed config key zerowatch knows, and what it does with it.

Three tables and one map, read by the parser (zerowatch/config.py) and rendered into
docs/migrating-from-deepspeed.md (`python -m zerowatch._config_keys` prints the tables; a
test keeps the document and these tables in step):

- HONOURED: keys the engine reads and acts on.
- IGNORED: keys that change nothing about the training result here (logging, profiling,
  NVMe tuning for a device zerowatch does not use); reading one warns and drops it.
- REFUSED: features zerowatch does not implement. A refused key set to its "off" value
  (the DeepSpeed default) is accepted silently, anything else is a ConfigError, because
  ignoring it would train something other than what the config asks for.
- ALIASES: DeepSpeed's other names for honoured keys, renamed before reading.

Paths are dotted from the top of the config. Standard library only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

ZERO = "zero_optimization"
OFFLOAD_OPT = f"{ZERO}.offload_optimizer"
OFFLOAD_PARAM = f"{ZERO}.offload_param"


class Refused(NamedTuple):
    """Why a key is refused, and the values that mean "feature off" (accepted silently)."""

    reason: str
    off: tuple[Any, ...] = (False, None)


HONOURED: dict[str, str] = {
    # Batch sizes: train_batch_size = micro * gradient_accumulation_steps * world size.
    "train_batch_size": "global batch per optimizer step; `auto` from the other two",
    "train_micro_batch_size_per_gpu": "batch per rank per forward; `auto` from the other two",
    "gradient_accumulation_steps": "micro-batches per optimizer step; `auto` from the other two",
    "gradient_clipping": "max global gradient norm across shards (0 = off)",
    "gradient_predivide_factor": "f > 1: gradients times 1/f before the sum across ranks, f/N after; 1: divided by N before the sum",
    "prescale_gradients": "accepted; gradients are divided before the sum either way",
    "steps_per_print": "how often the engine logs (rank 0)",
    "wall_clock_breakdown": "accepted; the agent always records per-phase wall clock",
    "zero_allow_untested_optimizer": "accepted; only Adam and AdamW exist here either way",
    ZERO: "the ZeRO section",
    f"{ZERO}.stage": "0 (DDP), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)",
    f"{ZERO}.offload_optimizer": "optimizer states and step on the CPU (stages 1-3)",
    f"{OFFLOAD_OPT}.device": '"cpu" or "none"',
    f"{OFFLOAD_OPT}.pin_memory": "pinned host buffers for the copies (GPU only)",
    f"{ZERO}.offload_param": "parameter shards on the CPU (stage 3)",
    f"{OFFLOAD_PARAM}.device": '"cpu" or "none"',
    f"{OFFLOAD_PARAM}.pin_memory": "pinned host buffers for the copies (GPU only)",
    f"{ZERO}.overlap_comm": "gradient reduction runs asynchronously with the rest of backward",
    f"{ZERO}.contiguous_gradients": "gradients copied into one flat buffer as they are reduced",
    f"{ZERO}.reduce_scatter": "reduce-scatter (not all-reduce) for gradients at stages 1-2",
    f"{ZERO}.reduce_bucket_size": "elements per gradient-reduction bucket; `auto` = hidden²",
    f"{ZERO}.allgather_partitions": "all-gather updated parameters (stages 1-2)",
    f"{ZERO}.allgather_bucket_size": "elements per parameter all-gather bucket (stages 1-2)",
    f"{ZERO}.stage3_prefetch_bucket_size": "elements prefetched ahead (stage 3); `auto` = 0.9·hidden²",
    f"{ZERO}.stage3_param_persistence_threshold": "parameters smaller than this stay whole (stage 3); `auto` = 10·hidden",
    f"{ZERO}.stage3_max_live_parameters": "cap on gathered elements held beyond the modules running: prefetched or kept for reuse (stage 3)",
    f"{ZERO}.stage3_max_reuse_distance": "keep a unit gathered after a forward use if the forward uses it again within this many elements (stage 3)",
    f"{ZERO}.sub_group_size": "elements per optimizer-step group (offloaded step)",
    f"{ZERO}.stage3_gather_16bit_weights_on_model_save": "gather full 16-bit weights on save (stage 3)",
    f"{ZERO}.cpu_offload": "deprecated: `true` means offload_optimizer.device = cpu",
    f"{ZERO}.cpu_offload_param": "deprecated: `true` means offload_param.device = cpu",
    f"{ZERO}.cpu_offload_use_pin_memory": "deprecated: pin_memory for both offloads",
    "fp16": "fp16 with fp32 master weights and dynamic loss scaling",
    "fp16.enabled": "turn fp16 on",
    "fp16.auto_cast": "cast floating-point inputs of the forward to fp16",
    "fp16.loss_scale": "0 = dynamic loss scaling, otherwise a static scale",
    "fp16.initial_scale_power": "first dynamic scale is 2**power",
    "fp16.loss_scale_window": "steps without overflow before the scale doubles",
    "fp16.hysteresis": "overflows tolerated before the scale halves",
    "fp16.consecutive_hysteresis": "refill hysteresis after each step without overflow",
    "fp16.min_loss_scale": "the scale never drops below this",
    "bf16": "bf16 with fp32 master weights",
    "bf16.enabled": "turn bf16 on",
    "optimizer": "the optimizer built from the config",
    "optimizer.type": '"Adam" or "AdamW" (any case)',
    "optimizer.params": "its parameters",
    "optimizer.params.lr": "learning rate (default 1e-3)",
    "optimizer.params.betas": "[beta1, beta2] (default [0.9, 0.999])",
    "optimizer.params.eps": "default 1e-8",
    "optimizer.params.weight_decay": "default 0",
    "optimizer.params.adam_w_mode": 'decoupled weight decay for "Adam" (DeepSpeed default true)',
    "optimizer.params.torch_adam": "accepted (the step is torch's Adam/AdamW either way)",
    "optimizer.params.bias_correction": "must be true (torch's Adam always corrects bias)",
    "optimizer.params.amsgrad": "must be false",
    "scheduler": "the learning-rate scheduler built from the config",
    "scheduler.type": "WarmupLR, WarmupDecayLR or WarmupCosineLR",
    "scheduler.params": "its parameters (DeepSpeed's names)",
    "scheduler.params.warmup_min_lr": "WarmupLR, WarmupDecayLR (default 0; `auto` = 0)",
    "scheduler.params.warmup_max_lr": "WarmupLR, WarmupDecayLR (default 1e-3; `auto` = optimizer lr)",
    "scheduler.params.warmup_num_steps": "all three (default 1000)",
    "scheduler.params.warmup_type": 'all three: "log" or "linear" (default "log")',
    "scheduler.params.last_batch_iteration": "all three (default -1)",
    "scheduler.params.total_num_steps": "WarmupDecayLR, WarmupCosineLR (required)",
    "scheduler.params.warmup_min_ratio": "WarmupCosineLR (default 0)",
    "scheduler.params.cos_min_ratio": "WarmupCosineLR (default 1e-4)",
}

ALIASES: dict[str, str] = {
    f"{ZERO}.stage3_gather_fp16_weights_on_model_save": f"{ZERO}.stage3_gather_16bit_weights_on_model_save",
    f"{ZERO}.gather_16bit_weights_on_model_save": f"{ZERO}.stage3_gather_16bit_weights_on_model_save",
    f"{ZERO}.prefetch_bucket_size": f"{ZERO}.stage3_prefetch_bucket_size",
    f"{ZERO}.param_persistence_threshold": f"{ZERO}.stage3_param_persistence_threshold",
    f"{ZERO}.max_live_parameters": f"{ZERO}.stage3_max_live_parameters",
    f"{ZERO}.max_reuse_distance": f"{ZERO}.stage3_max_reuse_distance",
    "bfloat16": "bf16",
}

IGNORED: dict[str, str] = {
    "tensorboard": "logging; the zerowatch agent records the run",
    "wandb": "logging; the zerowatch agent records the run",
    "csv_monitor": "logging; the zerowatch agent records the run",
    "comet": "logging; the zerowatch agent records the run",
    "comms_logger": "logging; the agent records every collective",
    "flops_profiler": "profiling; use the agent's per-phase timings",
    "memory_breakdown": "logging; the agent records model-state bytes",
    "dump_state": "logging",
    "timers": "logging",
    "autotuning": "the DeepSpeed autotuner is a launcher feature",
    "activation_checkpointing": "configures deepspeed.checkpointing, which zerowatch models do not call",
    "checkpoint": "checkpoint-engine tuning; zerowatch writes torch files",
    "nebula": "checkpoint-engine tuning; zerowatch writes torch files",
    "use_node_local_storage": "checkpoint-engine tuning; zerowatch writes torch files",
    "aio": "NVMe I/O tuning; zerowatch does not offload to NVMe",
    "dataloader_drop_last": "zerowatch does not build the data loader",
    "zero_force_ds_cpu_optimizer": "the offloaded step is torch's Adam/AdamW on the CPU",
    "compile": "zerowatch does not torch.compile the model for you",
    "graph_harvesting": "CUDA-graph tuning",
    "seq_parallel_communication_data_type": "sequence parallelism is not used",
    f"{ZERO}.elastic_checkpoint": "checkpoint layout tuning",
    f"{ZERO}.load_from_fp32_weights": "checkpoints always hold fp32 master weights",
    f"{ZERO}.round_robin_gradients": "a performance hint for CPU offload",
    f"{ZERO}.ignore_unused_parameters": "unused parameters get no gradient and are skipped",
    f"{ZERO}.legacy_stage1": "old DeepSpeed code path",
    f"{ZERO}.use_multi_rank_bucket_allreduce": "a performance hint",
    f"{ZERO}.stage3_model_persistence_threshold": "persistence is decided per parameter only",
    f"{ZERO}.model_persistence_threshold": "persistence is decided per parameter only",
    f"{ZERO}.memory_efficient_linear": "a DeepSpeed kernel choice",
    f"{ZERO}.pipeline_loading_checkpoint": "a DeepSpeed pipeline option",
    f"{ZERO}.override_module_apply": "a DeepSpeed init hook",
    f"{ZERO}.module_granularity_threshold": "a DeepSpeed fetch-granularity hint",
    f"{ZERO}.use_all_reduce_for_fetch_params": "a DeepSpeed fetch hint",
    f"{ZERO}.stage3_use_all_reduce_for_fetch_params": "a DeepSpeed fetch hint",
    f"{ZERO}.log_trace_cache_warnings": "logging",
    f"{OFFLOAD_OPT}.nvme_path": "NVMe only",
    f"{OFFLOAD_OPT}.buffer_count": "NVMe only",
    f"{OFFLOAD_OPT}.pipeline_read": "NVMe only",
    f"{OFFLOAD_OPT}.pipeline_write": "NVMe only",
    f"{OFFLOAD_OPT}.fast_init": "NVMe only",
    f"{OFFLOAD_PARAM}.nvme_path": "NVMe only",
    f"{OFFLOAD_PARAM}.buffer_count": "NVMe only",
    f"{OFFLOAD_PARAM}.buffer_size": "NVMe only",
    f"{OFFLOAD_PARAM}.max_in_cpu": "NVMe only",
    "bf16.immediate_grad_update": "gradients are accumulated in fp32 either way",
    "bf16.check_grad_overflow": "bf16 does not overflow the way fp16 does",
    "optimizer.params.set_grad_none": "gradients are always released after the step",
}

REFUSED: dict[str, Refused] = {
    "pipeline": Refused("pipeline parallelism is not implemented", (None, {})),
    "tensor_parallel": Refused("tensor parallelism is not implemented", (None, {})),
    "sequence_parallel_size": Refused("sequence parallelism is not implemented", (None, 1)),
    "elasticity": Refused("elastic training is not implemented"),
    "amp": Refused('apex AMP is not used; use "bf16" or "fp16"'),
    "sparse_attention": Refused("sparse-attention kernels are not implemented", (None, {})),
    "compression_training": Refused("compression training is not implemented", (None, {})),
    "data_efficiency": Refused("data-efficiency sampling is not implemented"),
    "curriculum_learning": Refused("curriculum learning is not implemented"),
    "hybrid_engine": Refused("the RLHF hybrid engine is not implemented"),
    "weight_quantization": Refused("weight quantisation is not implemented", (None, {})),
    "quantize_training": Refused("quantised training is not implemented"),
    "sparse_gradients": Refused("sparse gradients are not implemented"),
    "communication_data_type": Refused("collectives run in the training precision"),
    "data_types": Refused("gradients accumulate in the training precision", (None, {})),
    "disable_allgather": Refused("the all-gather of updated parameters cannot be turned off"),
    "load_universal_checkpoint": Refused("universal checkpoints are not implemented"),
    f"{ZERO}.zero_quantized_weights": Refused("ZeRO++ quantised weights are not implemented"),
    f"{ZERO}.zero_quantized_nontrainable_weights": Refused(
        "ZeRO++ quantisation is not implemented"
    ),
    f"{ZERO}.zero_quantized_gradients": Refused("ZeRO++ quantised gradients are not implemented"),
    f"{ZERO}.zero_hpz_partition_size": Refused(
        "ZeRO++ hierarchical partitioning is not implemented", (None, 1)
    ),
    f"{ZERO}.zeropp_loco_param": Refused("ZeRO++ LoCo is not implemented"),
    f"{ZERO}.mics_shard_size": Refused("MiCS sharding is not implemented", (None, -1)),
    f"{ZERO}.mics_hierarchical_params_gather": Refused("MiCS sharding is not implemented"),
    f"{OFFLOAD_OPT}.ratio": Refused("partial offload is not implemented", (None, 1, 1.0)),
    "fp16.fp16_master_weights_and_grads": Refused("master weights are always fp32"),
    "bf16.bf16_master_weights_and_grads": Refused("master weights are always fp32"),
    "bf16.bf16_optimizer_states": Refused("optimizer states are always fp32"),
}


def section_keys(section: str) -> dict[str, str]:
    """Every key name the parser knows directly under `section` ("" = top level), with its
    kind: "honoured", "alias", "ignored" or "refused"."""
    out: dict[str, str] = {}
    for kind, table in (
        ("honoured", HONOURED),
        ("alias", ALIASES),
        ("ignored", IGNORED),
        ("refused", REFUSED),
    ):
        for path in table:
            parent, _, name = path.rpartition(".")
            if parent == section:
                out[name] = kind
    return out


def is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """True where a refused key's value means "feature off": one of its off values
    (compared by type too, so True is not 1), or an object with `"enabled": false`."""
    if isinstance(value, dict) and value.get("enabled") is False:
        return True
    return any(type(value) is type(o) and value == o for o in off)


def markdown_tables() -> str:
    """The three tables of docs/migrating-from-deepspeed.md, as Markdown."""
    lines = ["### Honoured", "", "| key | what zerowatch does |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in HONOURED.items()]
    lines += [
        "",
        "Other names DeepSpeed accepts for the same keys:",
        "",
        "| key | same as |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | `{v}` |" for k, v in ALIASES.items()]
    lines += [
        "",
        "### Ignored with a warning",
        "",
        "| key | why ignoring it is harmless |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {v} |" for k, v in IGNORED.items()]
    lines += ["", "### Refused (a `ConfigError`)", ""]
    lines += ['Accepted silently only when "off": one of the values shown, or an object with']
    lines += ['`"enabled": false`.', ""]
    lines += ["| key | off | why |", "|---|---|---|"]
    for k, r in REFUSED.items():
        lines.append(f"| `{k}` | {', '.join(_json(o) for o in r.off)} | {r.reason} |")
    return "\n".join(lines) + "\n"


def _json(value: Any) -> str:
    import json

    return f"`{json.dumps(value)}`"


if __name__ == "__main__":  # pragma: no cover
    print(markdown_tables(), end="")
