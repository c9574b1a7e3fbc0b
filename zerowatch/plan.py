"""The capacity planner: what each ZeRO stage and offload choice needs, before you run it.

For a model of Ψ parameters on N GPUs it works out, per rank and per optimizer step
(mixed-precision Adam, the ZeRO paper's model in zerowatch.theory):

- device memory by kind: parameters, gradients, optimizer states, fp32 master weights
  (2Ψ + 2Ψ + 12Ψ under DDP; stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N), plus the
  transient buffers the engine's config implies: the gradient-reduction bucket
  (`reduce_bucket_size` elements, two of them with `overlap_comm`), the stage 1-2 all-gather
  bucket (`allgather_bucket_size`) and, at stage 3, the gathered (live) parameters
  (`stage3_max_live_parameters`, or the prefetch bucket if larger, never more than Ψ);
- host memory per node for CPU offload (optimizer states, fp32 master weights and an fp32
  gradient partition; parameter shards too with parameter offload);
- communication per rank: the collective sizes of theory.comm_bytes_per_step, the bytes a
  rank actually sends (theory.comm_traffic_bytes) and, given the bus bandwidth, the time
  that costs; and the host<->device copies that offload adds.

Activations, temporary tensors and the framework's own overhead come on top, which is why
every row also shows the headroom that is left.

The recommendation is the cheapest configuration that fits: without offload before with it
(offload moves the optimizer step to the CPU and adds PCIe traffic every step, typically a
2-3x slower step), and within each the lowest stage (stages 0-2 move 2Ψ per step, stage 3
3Ψ). `plan()` returns plain data (`to_dict()` for JSON and the /plan page);
`plan_from_cli()` parses the `zerowatch plan` options and renders a table or JSON.

Standard library, zerowatch.theory, zerowatch.config and zerowatch.units only (rich, a core
dependency, is imported when a table is rendered). Bytes print in binary units, as on the
/plan page (zerowatch.units says why).
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from zerowatch import theory
from zerowatch.config import ConfigError, ZeroWatchConfig, load_config, read_config_source
from zerowatch.units import fmt_bytes, fmt_count, fmt_seconds

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD_CHOICES = ("none", "cpu", "both")


class PlanError(ValueError):
    """Bad planner input; the message starts with the option it is about."""


@dataclass(frozen=True)
class Layout:
    """One candidate configuration: a stage and where the offloadable states live."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False

    @property
    def offload(self) -> str:
        """ "none", "optimizer" or "optimizer+params" (or "params")."""
        parts = [
            n
            for n, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param))
            if on
        ]
        return "+".join(parts) or "none"


#: Every layout the planner compares, cheapest first (see the module docstring).
LAYOUTS = (
    Layout(0), Layout(1), Layout(2), Layout(3),
    Layout(1, True), Layout(2, True), Layout(3, True), Layout(3, True, True),
)  # fmt: skip


@dataclass(frozen=True)
class PlanInputs:
    """What the plan was computed for."""

    num_params: int
    gpus: int
    nodes: int
    gpu_memory_bytes: int
    precision: str
    bandwidth_bytes_per_s: float | None = None
    host_memory_bytes: int | None = None
    gradient_accumulation_steps: int = 1
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    overlap_comm: bool = False

    @property
    def ranks_per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True)
class PlanRow:
    """What one layout needs per rank and per optimizer step."""

    stage: int
    offload: str
    offload_optimizer: bool
    offload_param: bool
    model_states: dict[str, int]
    """Device bytes by kind: params, grads, optimizer_states, master_weights."""
    buffers: dict[str, int]
    """Transient device bytes: reduce_bucket, allgather_bucket, live_params."""
    device_bytes: int
    """Model states plus buffers on one GPU."""
    headroom_bytes: int
    """GPU memory left for activations (negative: does not fit)."""
    host_bytes_per_rank: int
    host_bytes_per_node: int
    comm_sizes: dict[str, int]
    """Collective sizes per op (nccl-tests "size"), theory.comm_bytes_per_step."""
    comm_bytes: int
    """Bytes one rank sends per step (theory.comm_traffic_bytes)."""
    comm_time_s: float | None
    """comm_bytes / bus bandwidth, where a bandwidth was given."""
    offload_copy_bytes: int
    """Host<->device bytes per step that offload adds (both directions)."""
    fits: bool
    """Device bytes within the GPU memory (and host bytes within host memory, if given)."""

    @property
    def model_state_bytes(self) -> int:
        return sum(self.model_states.values())


@dataclass(frozen=True)
class PlanResult:
    inputs: PlanInputs
    rows: tuple[PlanRow, ...]
    recommended: PlanRow | None
    """The cheapest row that fits, or None."""
    config_row: PlanRow | None = None
    """With a config: what that config's stage and offload need."""
    config_source: str | None = None
    min_gpus: int | None = None
    """Where nothing fits: the fewest GPUs of this size on which the leanest compared
    layout (the last row) fits, host memory aside; None if its buffers alone do not fit."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    num_params: int,
    *,
    gpus: int,
    gpu_memory: int,
    nodes: int = 1,
    precision: str = "bf16",
    offload: str = "both",
    bandwidth: float | None = None,
    host_memory: int | None = None,
    config: ZeroWatchConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    hidden_size: int | None = None,
) -> PlanResult:
    """Per-rank memory and communication for every ZeRO stage and offload choice.

    Args:
        num_params: Ψ, trainable parameters.
        gpus: data-parallel ranks in all.
        gpu_memory: bytes of memory per GPU.
        nodes: machines the GPUs are spread over (host memory is per node).
        precision: "fp32", "bf16" or "fp16" (a config's own precision wins).
        offload: "none", "cpu" (only offload layouts) or "both".
        bandwidth: bus bandwidth per GPU in bytes/s, to turn bytes into seconds.
        host_memory: bytes of CPU memory per node, to check offload layouts against.
        config: a DeepSpeed config (or its path): its buckets and accumulation steps are
            used for every row, and its own stage and offload become `config_row`.
            "auto" values that need the model are planned with DeepSpeed's defaults.
        hidden_size: the model's hidden size, to resolve "auto" bucket sizes.

    Returns:
        A PlanResult; `to_dict()` gives JSON-ready data.

    Raises:
        PlanError: an input out of range. ConfigError: a config mistake.
    """
    _check(num_params >= 1, f"params: expected >= 1, got {num_params}")
    _check(gpus >= 1, f"gpus: expected >= 1, got {gpus}")
    _check(nodes >= 1, f"nodes: expected >= 1, got {nodes}")
    _check(gpus % nodes == 0, f"nodes: {gpus} GPUs do not split evenly over {nodes} nodes")
    _check(gpu_memory > 0, f"gpu_memory: expected > 0 bytes, got {gpu_memory}")
    _check(
        precision in PRECISIONS,
        f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}",
    )
    _check(offload in OFFLOAD_CHOICES, f"offload: expected none, cpu or both, got {offload!r}")
    _check(bandwidth is None or bandwidth > 0, f"bandwidth: expected > 0, got {bandwidth}")
    notes: list[str] = []
    cfg, source = None, None
    if config is not None:
        source = "dict" if isinstance(config, Mapping) else str(config)
        if isinstance(config, ZeroWatchConfig):
            cfg, source = config, "config"
        else:
            cfg = _load_for_planning(config, gpus, hidden_size, precision, notes)
        if cfg.precision != precision:
            notes.append(f"precision {cfg.precision} from the config")
        precision = cfg.precision
    buckets: dict[str, Any] = {}
    if cfg is not None:
        z = cfg.zero_optimization
        buckets = {
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "reduce_bucket_size": z.reduce_bucket_size,
            "allgather_bucket_size": z.allgather_bucket_size,
            "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
            "stage3_max_live_parameters": z.stage3_max_live_parameters,
            "overlap_comm": z.overlap_comm,
        }
    inputs = PlanInputs(
        num_params=num_params, gpus=gpus, nodes=nodes, gpu_memory_bytes=gpu_memory,
        precision=precision, bandwidth_bytes_per_s=bandwidth, host_memory_bytes=host_memory,
        **buckets,
    )  # fmt: skip
    wanted = {"none": (False,), "cpu": (True,), "both": (False, True)}[offload]
    rows = tuple(_row(inputs, lay) for lay in LAYOUTS if lay.offload_optimizer in wanted)
    recommended = next((r for r in rows if r.fits), None)
    config_row = None
    if cfg is not None:
        z = cfg.zero_optimization
        layout = Layout(z.stage, z.offload_optimizer.enabled, z.offload_param.enabled)
        config_row = _row(inputs, layout)
    min_gpus = (
        None if recommended else _min_gpus(inputs, LAYOUTS[-1] if True in wanted else Layout(3))
    )
    return PlanResult(
        inputs=inputs, rows=rows, recommended=recommended, config_row=config_row,
        config_source=source, min_gpus=min_gpus, notes=tuple(notes),
    )  # fmt: skip


def buffer_bytes(
    num_params: int, precision: str, stage: int, *,
    reduce_bucket_size: int = PlanInputs.reduce_bucket_size,
    allgather_bucket_size: int = PlanInputs.allgather_bucket_size,
    stage3_prefetch_bucket_size: int = PlanInputs.stage3_prefetch_bucket_size,
    stage3_max_live_parameters: int = PlanInputs.stage3_max_live_parameters,
    overlap_comm: bool = PlanInputs.overlap_comm,
) -> dict[str, int]:  # fmt: skip
    """Transient device bytes per rank the engine's config implies at `stage` (module
    docstring): reduce_bucket, allgather_bucket (stages 1-2), live_params (stage 3)."""
    psi, p = num_params, theory.PARAM_BYTES[precision]
    return {
        "reduce_bucket": min(reduce_bucket_size, psi) * p * (2 if overlap_comm else 1),
        "allgather_bucket": min(allgather_bucket_size, psi) * p if stage in (1, 2) else 0,
        "live_params": (
            min(max(stage3_max_live_parameters, stage3_prefetch_bucket_size), psi) * p
            if stage == 3 else 0
        ),
    }  # fmt: skip


def _row(inputs: PlanInputs, layout: Layout) -> PlanRow:
    psi, n, p = inputs.num_params, inputs.gpus, theory.PARAM_BYTES[inputs.precision]
    ga = inputs.gradient_accumulation_steps
    states = theory.model_state_bytes(
        psi, n, layout.stage, precision=inputs.precision,
        offload_optimizer=layout.offload_optimizer, offload_param=layout.offload_param,
    )  # fmt: skip
    buffers = buffer_bytes(
        psi, inputs.precision, layout.stage, reduce_bucket_size=inputs.reduce_bucket_size,
        allgather_bucket_size=inputs.allgather_bucket_size,
        stage3_prefetch_bucket_size=inputs.stage3_prefetch_bucket_size,
        stage3_max_live_parameters=inputs.stage3_max_live_parameters,
        overlap_comm=inputs.overlap_comm,
    )  # fmt: skip
    if n == 1:  # nothing is reduced or gathered across ranks
        buffers = dict.fromkeys(buffers, 0)
    device = states.device_total + sum(buffers.values())
    host_node = states.host_total * inputs.ranks_per_node
    sizes = theory.comm_bytes_per_step(psi, n, layout.stage, precision=inputs.precision,
                                       gradient_accumulation_steps=ga)  # fmt: skip
    traffic = theory.comm_traffic_bytes(sizes, n)
    fits = device <= inputs.gpu_memory_bytes
    if inputs.host_memory_bytes is not None and host_node > inputs.host_memory_bytes:
        fits = False
    return PlanRow(
        stage=layout.stage, offload=layout.offload, offload_optimizer=layout.offload_optimizer,
        offload_param=layout.offload_param, model_states=dict(states.device), buffers=buffers,
        device_bytes=device, headroom_bytes=inputs.gpu_memory_bytes - device,
        host_bytes_per_rank=states.host_total, host_bytes_per_node=host_node,
        comm_sizes=sizes, comm_bytes=traffic,
        comm_time_s=traffic / inputs.bandwidth_bytes_per_s if inputs.bandwidth_bytes_per_s else None,
        offload_copy_bytes=_offload_copies(psi, n, p, ga, layout), fits=fits,
    )  # fmt: skip


def _offload_copies(psi: int, n: int, p: int, ga: int, layout: Layout) -> int:
    """Host<->device bytes per step: gradient shards go down (once per step at stage 1,
    per micro-batch at stages 2-3), updated parameter shards come back; with parameter
    offload the shard is fetched for the forward and the backward of every micro-batch."""
    if not layout.offload_optimizer and not layout.offload_param:
        return 0
    part = theory.shard(psi, n) * p
    down = part * (1 if layout.stage == 1 else ga) if layout.offload_optimizer else 0
    up = 2 * ga * part if layout.offload_param else part
    return down + up


def _min_gpus(inputs: PlanInputs, layout: Layout) -> int | None:
    """The fewest GPUs on which `layout` fits on the device (doubling, then bisection)."""

    def fits(n: int) -> bool:
        trial = replace(inputs, gpus=n, nodes=1, host_memory_bytes=None)
        return _row(trial, layout).fits

    hi = max(inputs.gpus, 1)
    while not fits(hi):
        hi *= 2
        if hi > 1 << 24:
            return None  # the buffers alone do not fit
    lo = hi // 2 if hi > inputs.gpus else hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return hi


_HIDDEN_KEYS = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)


def _load_for_planning(
    source: Mapping[str, Any] | str | os.PathLike[str],
    gpus: int,
    hidden_size: int | None,
    precision: str,
    notes: list[str],
) -> ZeroWatchConfig:
    """load_config, lenient where a training run would need values the planner does not:
    the optimizer and scheduler sections (Adam is assumed) are left out, "auto" precision
    follows `precision`, and other "auto" values are planned with DeepSpeed's defaults."""
    raw = read_config_source(source)
    raw.pop("optimizer", None)
    raw.pop("scheduler", None)
    for section, on in (("fp16", precision == "fp16"), ("bf16", precision == "bf16")):
        if isinstance(raw.get(section), dict) and raw[section].get("enabled") == "auto":
            raw[section] = {**raw[section], "enabled": on}
            notes.append(
                f'{section}.enabled: "auto" planned as {str(on).lower()} (the --precision)'
            )
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        zero = dict(zero)
        for k, v in list(zero.items()):
            if v == "auto" and not (k in _HIDDEN_KEYS and hidden_size):
                del zero[k]
                notes.append(f'zero_optimization.{k}: "auto" planned with DeepSpeed\'s default')
        raw["zero_optimization"] = zero
    if raw.get("gradient_clipping") == "auto":
        del raw["gradient_clipping"]
    return load_config(raw, world_size=gpus, hidden_size=hidden_size)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


# ---- parsing the command line's human-friendly numbers ------------------------------------

_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}  # fmt: skip


def parse_count(text: str, option: str = "--params") -> int:
    """ "70e9", "7B", "350M", "1.5T", "70000000000" -> a parameter count."""
    m = re.fullmatch(_NUMBER + r"([A-Za-z]?)\s*", text)
    if not m or m.group(2).lower() not in _COUNT_SUFFIX:
        raise PlanError(f"{option}: expected a parameter count like 70e9, 7B or 350M, got {text!r}")
    value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]
    if value < 1:
        raise PlanError(f"{option}: expected at least 1 parameter, got {text!r}")
    return round(value)


def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    """ "80GiB", "80GB", "512MiB", "1.5TB" -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(_NUMBER + r"([KMGTPkmgtp]i?)?[Bb]\s*", text)
    if not m:
        raise PlanError(f"{option}: expected a size with a unit like 80GiB or 80GB, got {text!r}")
    value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    if value <= 0:
        raise PlanError(f"{option}: expected more than 0 bytes, got {text!r}")
    return round(value)


def parse_bandwidth(text: str, option: str = "--bandwidth") -> float:
    """ "100GB/s", "25GiB/s", "400Gbit/s", "400Gb/s", "400Gbps" -> bytes per second
    (a capital B is bytes, "bit" or a small b is bits)."""
    m = re.fullmatch(_NUMBER + r"([KMGTPkmgtp]i?)?(B|b|bit)(?:/s|ps)\s*", text)
    if not m:
        raise PlanError(f"{option}: expected a rate like 100GB/s or 400Gbit/s, got {text!r}")
    value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    value = value if m.group(3) == "B" else value / 8
    if value <= 0:
        raise PlanError(f"{option}: expected more than 0, got {text!r}")
    return value


def plan_from_cli(
    params: str,
    gpus: int,
    gpu_memory: str,
    nodes: int,
    offload: str,
    precision: str,
    bandwidth: str | None,
    config: Path | None,
    as_json: bool,
    host_memory: str | None = None,
    hidden_size: int | None = None,
) -> str:
    """`zerowatch plan`: parse the options, plan, render a table (or JSON).

    Raises:
        PlanError: naming the option at fault. ConfigError: a mistake inside --config.
    """
    num_params = parse_count(params, "--params")
    memory = parse_bytes(gpu_memory, "--gpu-memory")
    rate = parse_bandwidth(bandwidth, "--bandwidth") if bandwidth else None
    host = parse_bytes(host_memory, "--host-memory") if host_memory else None
    _check(
        hidden_size is None or hidden_size >= 1, f"--hidden-size: expected >= 1, got {hidden_size}"
    )
    _check(gpus >= 1, f"--gpus: expected >= 1, got {gpus}")
    _check(nodes >= 1, f"--nodes: expected >= 1, got {nodes}")
    _check(gpus % nodes == 0, f"--nodes: {gpus} GPUs do not split evenly over {nodes} nodes")
    _check(offload in OFFLOAD_CHOICES, f"--offload: expected none, cpu or both, got {offload!r}")
    _check(precision in PRECISIONS, f"--precision: expected fp32, bf16 or fp16, got {precision!r}")
    if config is not None and not Path(config).is_file():
        raise PlanError(f"--config: file not found: {config}")
    result = plan(
        num_params, gpus=gpus, gpu_memory=memory, nodes=nodes, precision=precision,
        offload=offload, bandwidth=rate, config=config, host_memory=host,
        hidden_size=hidden_size,
    )  # fmt: skip
    if as_json:
        return json.dumps(result.to_dict(), indent=2)
    return render_table(result)


# ---- rendering -----------------------------------------------------------------------------


def _describe(row: PlanRow) -> str:
    where = {"none": "no offload", "optimizer": "optimizer offload to CPU",
             "optimizer+params": "optimizer and parameter offload to CPU",
             "params": "parameter offload to CPU"}[row.offload]  # fmt: skip
    return f"stage {row.stage}, {where}"


def _summary(inputs: PlanInputs, row: PlanRow) -> str:
    text = (
        f"{fmt_bytes(row.device_bytes)} of {fmt_bytes(inputs.gpu_memory_bytes)} per GPU "
        f"({fmt_bytes(row.headroom_bytes)} left for activations)"
    )
    if row.host_bytes_per_node:
        text += f", {fmt_bytes(row.host_bytes_per_node)} of host memory per node"
    text += f", {fmt_bytes(row.comm_bytes)} sent per rank per step"
    if row.comm_time_s is not None:
        text += f" ({fmt_seconds(row.comm_time_s)} at the given bandwidth)"
    return text


def render_table(result: PlanResult) -> str:
    """The plan as a rich table plus a recommendation, as plain text."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    i = result.inputs
    title = (
        f"{fmt_count(i.num_params)} parameters, {i.precision}, Adam, {i.gpus} GPU(s) of "
        f"{fmt_bytes(i.gpu_memory_bytes)} on {i.nodes} node(s)"
    )
    table = Table(
        title=title, box=box.SIMPLE_HEAD, caption="per rank, per optimizer step; 1 GiB = 2^30 bytes"
    )
    for name in ("stage", "offload", "params", "grads", "optim", "master", "buffers",
                 "GPU/rank", "fits", "host/node", "sent/step", "comm time"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("stage", "offload", "fits") else "right")
    rows = list(result.rows)
    if result.config_row is not None:
        rows.append(result.config_row)
    for k, r in enumerate(rows):
        s = r.model_states
        mark = "yes" if r.fits else "no"
        if r is result.recommended:
            mark += " ★"
        stage = f"{r.stage} (config)" if k == len(result.rows) else str(r.stage)
        table.add_row(
            stage, r.offload, *(fmt_bytes(s[k], "-") for k in
                                 ("params", "grads", "optimizer_states", "master_weights")),
            fmt_bytes(sum(r.buffers.values()), "-"), fmt_bytes(r.device_bytes), mark,
            fmt_bytes(r.host_bytes_per_node, "-"), fmt_bytes(r.comm_bytes, "-"),
            fmt_seconds(r.comm_time_s),
            end_section=k == len(result.rows) - 1,
        )  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, width=150, color_system=None, highlight=False, soft_wrap=True)
    console.print(table)
    if result.recommended is not None:
        r = result.recommended
        console.print(f"Recommended: {_describe(r)} — {_summary(i, r)}.")
    else:
        console.print("Nothing fits on these GPUs.", end=" ")
        lean_row = result.rows[-1]
        lean = _describe(lean_row)
        if result.min_gpus and result.min_gpus <= i.gpus and i.host_memory_bytes:
            # The GPUs would do; host memory for the offloaded state is what runs out.
            console.print(
                f"{lean[0].upper()}{lean[1:]} needs {fmt_bytes(lean_row.host_bytes_per_node)} of "
                f"host memory per node, more than the {fmt_bytes(i.host_memory_bytes)} given."
            )
        elif result.min_gpus:
            console.print(
                f"{lean[0].upper()}{lean[1:]} needs at least {result.min_gpus} GPUs of this size."
            )
        else:
            console.print("Even the ZeRO buffers alone exceed one GPU's memory.")
    if result.config_row is not None:
        r = result.config_row
        verdict = "fits" if r.fits else "does NOT fit"
        console.print(
            f"Your config ({result.config_source}): {_describe(r)}, {i.precision}, buckets of "
            f"{fmt_count(i.reduce_bucket_size)} (reduce) and {fmt_count(i.allgather_bucket_size)} "
            f"(all-gather) elements, {fmt_count(i.stage3_max_live_parameters)} live parameters, "
            f"gradient accumulation {i.gradient_accumulation_steps}: {verdict} — {_summary(i, r)}."
        )
    for note in result.notes:
        console.print(f"note: {note}")
    return out.getvalue().rstrip("\n")


__all__ = [
    "LAYOUTS",
    "ConfigError",
    "Layout",
    "PlanError",
    "PlanInputs",
    "PlanResult",
    "PlanRow",
    "buffer_bytes",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
    "plan",
    "plan_from_cli",
    "render_table",
]
