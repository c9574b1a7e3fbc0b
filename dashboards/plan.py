"""Figures of the capacity-planner page (`/plan`): which ZeRO stage fits a model on a machine.

Input is one `StagePlan` per (stage, offload) option: per-rank model-state bytes on the device
and the host, and the collective bytes per step, as zerowatch.theory computes them (the page
gets them from zerowatch.plan, or `stage_plans` computes them here from the theory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from zerowatch.dashboards import theme as th

from zerowatch import theory
from zerowatch.events import STATE_KINDS


@dataclass(frozen=True)
class StagePlan:
    """One option of the planner: a ZeRO stage with or without CPU offload."""

    stage: int
    offload: bool
    #: Per-rank bytes on the device, by kind (events.STATE_KINDS).
    device: dict[str, float] = field(default_factory=dict)
    #: Per-rank bytes on the host (offloaded), by kind.
    host: dict[str, float] = field(default_factory=dict)
    #: Collective bytes (nccl-tests size) per step per rank, all ops together.
    comm_bytes: float = 0.0
    #: Bytes one rank actually sends per step (size times the bus factor).
    traffic_bytes: float = 0.0
    #: Whether the device bytes fit the device memory (with the headroom the planner uses).
    fits: bool = True

    @property
    def label(self) -> str:
        return f"ZeRO-{self.stage}" + (" + offload" if self.offload else "")

    @property
    def device_total(self) -> float:
        return float(sum(self.device.values()))


def stage_plans(
    num_params: int,
    world_size: int,
    gpu_memory_bytes: float,
    *,
    precision: str = "bf16",
    offloads: Sequence[bool] = (False, True),
    headroom: float = 0.8,
) -> list[StagePlan]:
    """Per-rank model-state and communication for each stage (0-3) and offload option.

    A stage "fits" when its device model states take at most `headroom` of the device memory
    (activations and fragmentation need the rest). Offload applies to stages 1-3 only.
    """
    rows: list[StagePlan] = []
    for offload in offloads:
        for stage in (0, 1, 2, 3):
            if offload and stage == 0:
                continue
            ms = theory.model_state_bytes(
                num_params,
                world_size,
                stage,
                precision=precision,
                offload_optimizer=offload,
                offload_param=offload and stage == 3,
            )
            sizes = theory.comm_bytes_per_step(num_params, world_size, stage, precision=precision)
            rows.append(
                StagePlan(
                    stage=stage,
                    offload=offload,
                    device=dict(ms.device),
                    host=dict(ms.host),
                    comm_bytes=float(sum(sizes.values())),
                    traffic_bytes=float(theory.comm_traffic_bytes(sizes, world_size)),
                    fits=ms.device_total <= headroom * gpu_memory_bytes,
                )
            )
    return rows


def memory(rows: Sequence[StagePlan], gpu_memory_bytes: float) -> go.Figure:
    """Per-rank device model-state bytes of each option, stacked by kind, against the
    device's memory; host (offloaded) bytes as a hatched bar beside it."""
    fig = th.figure("Memory per rank by ZeRO stage", height=420)
    x = [r.label for r in rows]
    for kind in STATE_KINDS:
        ys = [r.device.get(kind, 0) for r in rows]
        if any(ys):
            fig.add_trace(
                go.Bar(
                    x=x,
                    y=th.scaled(ys, th.GIB),
                    name=th.kind_label(kind),
                    marker={"color": th.KIND_COLORS[kind]},
                    offsetgroup="device",
                    hovertemplate="%{y:.4~f} GiB on the device",
                )
            )
    host = [sum(r.host.values()) for r in rows]
    if any(host):
        fig.add_trace(
            go.Bar(
                x=x,
                y=th.scaled(host, th.GIB),
                name="on the host (offloaded)",
                marker={"color": "#b2bec3", "pattern": {"shape": "x"}},
                offsetgroup="host",
                hovertemplate="%{y:.4~f} GiB in host memory",
            )
        )
    fig.add_hline(
        y=gpu_memory_bytes / th.GIB,
        line={"color": th.CAPACITY_COLOR, "dash": "dash"},
        annotation_text=f"GPU memory {th.fmt_bytes(gpu_memory_bytes)}",
        annotation_position="top left",
    )
    fig.update_layout(barmode="relative", yaxis={"title": {"text": "bytes per rank (GiB)"}})
    return fig


def communication(
    rows: Sequence[StagePlan], bandwidth_bytes_per_s: float | None = None
) -> go.Figure:
    """Collective bytes per step for each option; with a bus bandwidth, the seconds they take."""
    fig = make_subplots(specs=[[{"secondary_y": bandwidth_bytes_per_s is not None}]])
    fig.update_layout(th.base_layout("Communication per step by ZeRO stage", height=420))
    x = [r.label for r in rows]
    fig.add_trace(
        go.Bar(
            x=x,
            y=[r.comm_bytes / th.GIB for r in rows],
            name="collective size per step",
            marker={"color": "#F58518"},
            hovertemplate="%{y:.4~f} GiB per step",
        )
    )
    if bandwidth_bytes_per_s:
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[r.traffic_bytes / bandwidth_bytes_per_s for r in rows],
                name=f"time at {bandwidth_bytes_per_s / th.GB:.3g} GB/s bus bandwidth",
                mode="markers+lines",
                marker={"size": 10, "color": "#2d3436"},
                hovertemplate="%{y:.3~f} s per step",
            ),
            secondary_y=True,
        )
        fig.update_yaxes(title_text="seconds per step", secondary_y=True, rangemode="tozero")
    fig.update_yaxes(title_text="bytes per step (GiB)", secondary_y=False, rangemode="tozero")
    return fig


__all__ = ["StagePlan", "communication", "memory", "stage_plans"]
