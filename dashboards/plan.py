"""Figures of the capacity-planner page (`/plan`): which ZeRO stage fits a model on a machine.

Input is one `StagePlan` per (stage, offload) option: per-rank model-state and buffer bytes
on the device, bytes on the host, and the collective bytes per step. The page fills them
from zerowatch.plan (the same numbers as `zerowatch plan`); `stage_plans` computes the
paper's table from zerowatch.theory alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th

from zerowatch import theory
from zerowatch.events import STATE_KINDS

_LEGEND_RIGHT = {"orientation": "v", "x": 1.08, "xanchor": "left", "y": 1.0, "yanchor": "top"}


@dataclass(frozen=True)
class StagePlan:
    """One option of the planner: a ZeRO stage and what it offloads to the host."""

    stage: int
    #: What lives on the host: "none", "optimizer" or "optimizer+params".
    offload: str = "none"
    #: Per-rank model-state bytes on the device, by kind (events.STATE_KINDS).
    device: dict[str, float] = field(default_factory=dict)
    #: Per-rank transient device buffers (reduce bucket, all-gather bucket, live parameters).
    buffers: dict[str, float] = field(default_factory=dict)
    #: Per-rank bytes on the host (offloaded state).
    host_bytes: float = 0.0
    #: Collective bytes (nccl-tests size) per step per rank, all ops together.
    comm_bytes: float = 0.0
    #: Bytes one rank actually sends per step (size times the bus factor).
    traffic_bytes: float = 0.0
    #: Seconds those bytes take at the given bus bandwidth, if one was given.
    comm_time_s: float | None = None
    #: Whether everything the device holds fits its memory.
    fits: bool = True

    @property
    def label(self) -> str:
        return f"ZeRO-{self.stage}" + (
            "" if self.offload == "none" else f" + offload {self.offload}"
        )

    @property
    def device_total(self) -> float:
        return float(sum(self.device.values()) + sum(self.buffers.values()))


def stage_plans(
    num_params: int, world_size: int, gpu_memory_bytes: float, *, precision: str = "bf16"
) -> list[StagePlan]:
    """Model states and communication of stages 0-3 without offload, from zerowatch.theory
    alone (no buffers): the paper's own table."""
    rows = []
    for stage in (0, 1, 2, 3):
        ms = theory.model_state_bytes(num_params, world_size, stage, precision=precision)
        sizes = theory.comm_bytes_per_step(num_params, world_size, stage, precision=precision)
        rows.append(
            StagePlan(
                stage=stage, device={k: float(v) for k, v in ms.device.items()},
                comm_bytes=float(sum(sizes.values())),
                traffic_bytes=float(theory.comm_traffic_bytes(sizes, world_size)),
                fits=ms.device_total <= gpu_memory_bytes,
            )
        )  # fmt: skip
    return rows


def memory(rows: Sequence[StagePlan], gpu_memory_bytes: float) -> go.Figure:
    """Per-rank device model-state bytes of each option, stacked by kind, against the
    device's memory; host (offloaded) bytes as a hatched bar beside it."""
    fig = th.figure("Memory per rank by ZeRO stage", height=440, legend=_LEGEND_RIGHT,
                    margin={"l": 64, "r": 200, "t": 56, "b": 90})  # fmt: skip
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
    buffers = [sum(r.buffers.values()) for r in rows]
    if any(buffers):
        fig.add_trace(
            go.Bar(x=x, y=th.scaled(buffers, th.GIB), name="ZeRO buffers",
                   marker={"color": "#BAB0AC", "pattern": {"shape": "/"}}, offsetgroup="device",
                   hovertemplate="%{y:.4~f} GiB of buckets and live parameters")
        )  # fmt: skip
    host = [r.host_bytes for r in rows]
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
    # ZeRO-0 of a big model can need 10x a GPU: cut the axis at 3x the GPU's memory so the
    # options that fit stay readable, and write the cut bars' totals at the edge.
    cut = 3 * gpu_memory_bytes
    if max([r.device_total for r in rows] + host, default=0.0) > cut:
        fig.update_layout(yaxis_range=[0, cut / th.GIB],
                          title_text=f"{fig.layout.title.text} (axis cut at 3× GPU memory)")  # fmt: skip
        for r in rows:
            if r.device_total > cut:
                fig.add_annotation(x=r.label, y=cut / th.GIB, yanchor="top", showarrow=False,
                                   text=f"↑ {th.fmt_bytes(r.device_total)}",
                                   font={"size": 11, "color": "#2d3436"},
                                   bgcolor="rgba(255,255,255,0.85)")  # fmt: skip
    return fig


def communication(
    rows: Sequence[StagePlan], bandwidth_bytes_per_s: float | None = None
) -> go.Figure:
    """Bytes one rank sends per step for each option (the collective sizes times the bus
    factor: 2Ψ elements for stages 0-2, 3Ψ for stage 3, as the ZeRO paper counts); with a bus
    bandwidth, the seconds they take (right axis)."""
    fig = th.figure("Communication per step by ZeRO stage", height=440, legend=_LEGEND_RIGHT,
                    margin={"l": 64, "r": 200, "t": 56, "b": 90})  # fmt: skip
    x = [r.label for r in rows]
    fig.add_trace(
        go.Bar(x=x, y=[r.traffic_bytes / th.GIB for r in rows], name="bytes sent per rank",
               marker={"color": "#F58518"}, customdata=[r.comm_bytes / th.GIB for r in rows],
               hovertemplate="%{y:.4~f} GiB sent per step<br>"
                             "(collective size %{customdata:.4~f} GiB)")
    )  # fmt: skip
    if bandwidth_bytes_per_s:
        fig.add_trace(
            go.Scatter(x=x, y=[r.traffic_bytes / bandwidth_bytes_per_s for r in rows],
                       name=f"time at {bandwidth_bytes_per_s / th.GB:.3g} GB/s bus bandwidth",
                       mode="markers+lines", marker={"size": 10, "color": "#2d3436"},
                       hovertemplate="%{y:.3~f} s per step", yaxis="y2")
        )  # fmt: skip
        fig.update_layout(yaxis2={**th.AXIS_STYLE, "title": {"text": "seconds per step"},
                                  "overlaying": "y", "side": "right", "rangemode": "tozero",
                                  "showgrid": False})  # fmt: skip
    fig.update_layout(yaxis={"title": {"text": "bytes sent per step (GiB)"}, "rangemode": "tozero"})
    return fig


#: Charts of the planner page in page order: (id, full width?).
CHARTS = (("memory", True), ("comm", True))


def figures(
    rows: Sequence[StagePlan], gpu_memory_bytes: float, bandwidth_bytes_per_s: float | None
) -> dict[str, go.Figure]:
    """The planner page's charts by chart id."""
    return {
        "memory": memory(rows, gpu_memory_bytes),
        "comm": communication(rows, bandwidth_bytes_per_s),
    }


__all__ = ["CHARTS", "StagePlan", "communication", "figures", "memory", "stage_plans"]
