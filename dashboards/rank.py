"""Figures of the rank view (`/runs/{id}/ranks/{rank}`) and the node view
(`/runs/{id}/hosts/{host}`): one rank, or the ranks of one host, next to the run's median.

- step_time: is this rank slower than the median rank, and is it compute (busy time) or
  waiting on communication?
- parts: where does this rank's step go, part by part, against the run's mean rank?
- collectives: does this rank see slower collectives or a lower bus bandwidth?
- memory: does this rank peak higher, or hold more model state, than the median rank?
- training: do this rank's grad norm, loss and learning rate follow the run's?
- gpu: was this rank's GPU throttled (its SM clock against its maximum, beside the median
  rank's), and when?
- host_busy: on this node, which rank holds the others back?

The run's reference is the median over ranks at each sampled step (the rollups' p50),
drawn dashed; the rank's own values are solid. The exclusive parts are the exception: they
are means (a rank's parts add up to its step, and the run's mean parts to the mean step).
Every builder is a pure function of plain data returning a go.Figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th
from zerowatch.dashboards.data import Series

from zerowatch.events import GPU_REASON_LABELS, PHASES, STEP_PARTS

_STEP_AXIS = {"title": {"text": "step"}}
_MEDIAN = {"color": "#636e72", "width": 2, "dash": "dash"}


@dataclass
class RankView:
    """Everything the rank view draws: one rank and the run's median at the sampled steps."""

    run: dict[str, Any]
    rank: int
    host: str | None = None
    local_rank: int | None = None
    steps: list[int] = field(default_factory=list)
    #: The newest step any rank stored (-1: none yet).
    last_step: int = -1
    step_time: Series = field(default_factory=Series)
    step_time_median: Series = field(default_factory=Series)
    #: Step time less exposed communication: the time the rank computed.
    busy: Series = field(default_factory=Series)
    busy_median: Series = field(default_factory=Series)
    #: Mean seconds per step of each exclusive part: this rank's, and the run's mean rank's.
    parts: dict[str, float] = field(default_factory=dict)
    parts_run: dict[str, float] = field(default_factory=dict)
    latency: dict[str, Series] = field(default_factory=dict)
    latency_median: dict[str, Series] = field(default_factory=dict)
    busbw: dict[str, Series] = field(default_factory=dict)
    busbw_median: dict[str, Series] = field(default_factory=dict)
    #: Memory at the rank's newest step: peak bytes by phase and model-state bytes by kind,
    #: the rank's and the median rank's at the same step.
    memory_step: int | None = None
    peaks: dict[str, float] = field(default_factory=dict)
    peaks_median: dict[str, float] = field(default_factory=dict)
    model_state: dict[str, float] = field(default_factory=dict)
    model_state_median: dict[str, float] = field(default_factory=dict)
    grad_norm: Series = field(default_factory=Series)
    grad_norm_median: Series = field(default_factory=Series)
    loss: Series = field(default_factory=Series)
    loss_median: Series = field(default_factory=Series)
    lr: Series = field(default_factory=Series)
    lr_median: Series = field(default_factory=Series)
    #: The rank's GPU over the drawn steps (NVML; None without telemetry): throttled share,
    #: reasons, mean SM clock ratio, temperature, power ratio, XID and ECC errors (the
    #: doctor's `gpu_health`).
    gpu: dict[str, Any] | None = None
    #: SM clock over its maximum per step, the median rank's, and 1/0 per throttled step.
    gpu_clock: Series = field(default_factory=Series)
    gpu_clock_median: Series = field(default_factory=Series)
    gpu_throttled: Series = field(default_factory=Series)

    @property
    def busy_ratio(self) -> float | None:
        """The rank's mean busy time over the run's mean median busy time (same steps)."""
        return ratio_to_median(self.busy, self.busy_median)


@dataclass(frozen=True)
class HostRank:
    """One rank of a node, as the node view's table lists it."""

    rank: int
    local_rank: int | None
    busy: Series
    mean_busy_s: float | None
    #: mean busy time over the run's median busy time at the same steps.
    ratio: float | None
    #: Its GPU over the drawn steps (see RankView.gpu); None without telemetry.
    gpu: dict[str, Any] | None = None


@dataclass
class HostView:
    """The node view: the ranks of one host over the sampled steps, and the run's median."""

    run: dict[str, Any]
    host: str
    steps: list[int] = field(default_factory=list)
    busy_median: Series = field(default_factory=Series)
    #: The host's ranks, the one furthest above the median first.
    ranks: list[HostRank] = field(default_factory=list)


def ratio_to_median(mine: Series, median: Series) -> float | None:
    """mean(mine) / mean(median) over the steps both have a value at (1.0 = the median);
    None where they share no step or the median is zero."""
    ref = dict(zip(median.steps, median.values, strict=True))
    num = den = 0.0
    for s, v in zip(mine.steps, mine.values, strict=True):
        r = ref.get(s)
        if v is not None and r is not None:
            num += v
            den += r
    return num / den if den > 0 else None


def gpu_text(health: Mapping[str, Any] | None) -> str:
    """A rank's GPU health in a few words: "throttled (power cap) in 40% of steps, SM clock
    at 91% of max", "2 XID / 1 ECC errors", "healthy", or "–" without telemetry."""
    if not health:
        return "–"
    words = []
    if health.get("throttled_share"):
        reasons = ", ".join(GPU_REASON_LABELS.get(r, r) for r in health.get("reasons") or {})
        words.append(f"throttled ({reasons or 'clock events'}) in "
                     f"{health['throttled_share']:.0%} of steps")  # fmt: skip
        if health.get("sm_clock_ratio"):
            words.append(f"SM clock at {health['sm_clock_ratio']:.0%} of max")
    if health.get("xid_errors") or health.get("ecc_errors"):
        words.append(
            f"{health.get('xid_errors', 0)} XID / {health.get('ecc_errors', 0)} ECC errors"
        )
    return ", ".join(words) if words else "healthy (full clocks, no errors)"


def _line(s: Series, name: str, line: Mapping[str, object], hover: str, factor: float = 1.0,
          **kw: Any) -> go.Scatter:  # fmt: skip
    return th.scatter(x=list(s.steps), y=th.scaled(s.values, factor), name=name, mode="lines",
                      line=dict(line), hovertemplate=hover, **kw)  # fmt: skip


def step_time(
    rank: int, step: Series, step_median: Series, busy: Series, busy_median: Series
) -> go.Figure:
    """The rank's step time and busy time per step, each beside the run's median (dashed).

    Args:
        rank: the rank drawn, for the legend.
        step, busy: the rank's seconds per step.
        step_median, busy_median: the median over ranks, per step.
    """
    fig = th.figure(f"Rank {rank}: step time and busy time vs the median rank", height=380)
    ms = "%{y:.3~f} ms"
    if step:
        fig.add_trace(_line(step, f"rank {rank} step time", {"color": "#2d3436", "width": 2},
                            ms, 1e-3))  # fmt: skip
    if step_median:
        fig.add_trace(_line(step_median, "median rank step time", _MEDIAN, ms, 1e-3))
    if busy:
        fig.add_trace(_line(busy, f"rank {rank} busy time", {"color": "#E45756", "width": 2},
                            ms, 1e-3))  # fmt: skip
    if busy_median:
        fig.add_trace(_line(busy_median, "median rank busy time",
                            {**_MEDIAN, "color": "#F58518"}, ms, 1e-3))  # fmt: skip
    fig.update_layout(hovermode="x unified", xaxis=_STEP_AXIS,
                      yaxis={"title": {"text": "time per step (ms)"}, "rangemode": "tozero"})  # fmt: skip
    return fig


def parts(rank: int, mine: Mapping[str, float], run: Mapping[str, float]) -> go.Figure:
    """Mean seconds per step of each exclusive part, stacked: this rank against the run's
    mean rank. The parts never overlap, so each bar's length is that mean step time.

    Args:
        mine: part -> the rank's mean seconds per step.
        run: part -> the mean over ranks (and the same steps).
    """
    fig = th.figure("Where the step goes: exclusive parts (mean per step)", height=320,
                    barmode="stack", legend={**th.LEGEND_BELOW, "y": -0.4, "traceorder": "normal"},
                    margin={"l": 64, "r": 24, "t": 56, "b": 110})  # fmt: skip
    rows = [f"rank {rank}", "run (mean rank)"]
    known = [p for p in STEP_PARTS if p in mine or p in run]
    known += sorted((set(mine) | set(run)) - set(known))
    for name in known:
        fig.add_trace(
            go.Bar(y=rows, x=th.scaled([mine.get(name), run.get(name)], 1e-3), orientation="h",
                   name=th.PART_LABELS.get(name, th.text(name)),
                   marker={"color": th.PART_COLORS.get(name)}, hovertemplate="%{x:.3~f} ms")
        )  # fmt: skip
    fig.update_layout(xaxis={"title": {"text": "time per step (ms)"}},
                      yaxis={"autorange": "reversed"})  # fmt: skip
    return fig


def collectives(
    latency: Mapping[str, Series],
    latency_median: Mapping[str, Series],
    busbw: Mapping[str, Series],
    busbw_median: Mapping[str, Series],
) -> go.Figure:
    """Per collective op: the rank's latency per call and bus bandwidth (solid) against the
    run's median (dashed), over steps."""
    fig = th.rows_figure(
        "Collectives: this rank vs the median rank", ["latency per call", "bus bandwidth"],
        height=520, margin={"l": 64, "r": 24, "t": 56, "b": 110}, hovermode="x unified",
        legend={**th.LEGEND_BELOW, "y": -0.14},
    )  # fmt: skip
    ops = sorted(set(latency) | set(busbw) | set(latency_median) | set(busbw_median))
    for op in ops:
        color = th.OP_COLORS.get(op)
        label = th.op_label(op)
        for k, (mine, med, factor, hover) in enumerate(
            ((latency.get(op), latency_median.get(op), 1e-3, "%{y:.3~f} ms"),
             (busbw.get(op), busbw_median.get(op), th.GB, "%{y:.3~f} GB/s")), start=1,
        ):  # fmt: skip
            if mine:
                fig.add_trace(_line(mine, label, {"color": color}, hover, factor,
                                    legendgroup=op, showlegend=k == 1, **th.panel_axes(k)))  # fmt: skip
            if med:
                fig.add_trace(_line(med, f"{label} (median rank)", {"color": color, "dash": "dash"},
                                    hover, factor, legendgroup=op + "-median",
                                    showlegend=k == 1, **th.panel_axes(k)))  # fmt: skip
    fig.update_layout(
        yaxis={"title": {"text": "latency (ms)"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "bus bandwidth (GB/s)"}, "rangemode": "tozero"},
        xaxis2={"title": {"text": "step"}},
    )
    return fig


def memory(
    rank: int,
    peaks: Mapping[str, float],
    peaks_median: Mapping[str, float],
    model_state: Mapping[str, float],
    model_state_median: Mapping[str, float],
) -> go.Figure:
    """Peak memory by phase and model-state bytes by kind at the newest step: the rank's
    bars beside the median rank's."""
    phases: list[str] = [p for p in PHASES if p in peaks or p in peaks_median]
    phases += sorted((set(peaks) | set(peaks_median)) - set(phases))
    kinds = sorted(set(model_state) | set(model_state_median))
    x = [f"peak in {th.phase_label(p)}" for p in phases]
    x += [f"model state: {th.kind_label(k)}" for k in kinds]
    mine = [peaks.get(p) for p in phases] + [model_state.get(k) for k in kinds]
    med = [peaks_median.get(p) for p in phases] + [model_state_median.get(k) for k in kinds]
    top = max(th.finite(mine + med), default=0.0)
    unit, scale = ("GiB", th.GIB) if top >= th.GIB else ("MiB", 2**20)
    fig = th.figure(f"Memory: rank {rank} vs the median rank", height=520, barmode="group")
    hover = f"%{{y:.4~f}} {unit}"
    fig.add_trace(go.Bar(x=x, y=th.scaled(mine, scale), name=f"rank {rank}",
                         marker={"color": "#4C78A8"}, hovertemplate=hover))  # fmt: skip
    fig.add_trace(go.Bar(x=x, y=th.scaled(med, scale), name="median rank",
                         marker={"color": "#BAB0AC"}, hovertemplate=hover))  # fmt: skip
    fig.update_layout(yaxis={"title": {"text": f"memory ({unit})"}, "rangemode": "tozero"})
    return fig


def training(
    rank: int,
    signals: Sequence[tuple[str, Series, Series]],
) -> go.Figure:
    """One panel per training signal (grad norm, loss, learning rate): the rank's values and
    the run's median over ranks (dashed).

    Args:
        signals: (panel title, the rank's series, the median series), panels top to bottom.
    """
    drawn = [(t, mine, med) for t, mine, med in signals if mine or med]
    fig = th.rows_figure(f"Training signals: rank {rank} vs the median rank",
                         [t for t, _, _ in drawn] or ["no data"],
                         height=170 * max(len(drawn), 1) + 80, gap=0.08,
                         hovermode="x unified")  # fmt: skip
    for k, (_, mine, med) in enumerate(drawn, start=1):
        if mine:
            fig.add_trace(_line(mine, f"rank {rank}", {"color": "#4C78A8"}, "%{y:.4~g}",
                                legendgroup="rank", showlegend=k == 1, **th.panel_axes(k)))  # fmt: skip
        if med:
            fig.add_trace(_line(med, "median rank", _MEDIAN, "%{y:.4~g}", legendgroup="median",
                                showlegend=k == 1, **th.panel_axes(k)))  # fmt: skip
    fig.update_layout({f"xaxis{len(drawn)}" if len(drawn) > 1 else "xaxis": _STEP_AXIS})
    return fig


def gpu(rank: int, clock: Series, clock_median: Series, throttled: Series) -> go.Figure:
    """The rank's GPU SM clock over its maximum per step beside the median rank's (dashed),
    with the steps in which its GPU was throttled marked."""
    fig = th.figure(f"Rank {rank}: GPU SM clock vs the median rank", height=340)
    pct = "%{y:.1f}%"
    if clock:
        fig.add_trace(_line(clock, f"rank {rank} SM clock", {"color": "#4C78A8", "width": 2},
                            pct, 0.01))  # fmt: skip
    if clock_median:
        fig.add_trace(_line(clock_median, "median rank SM clock", _MEDIAN, pct, 0.01))
    hot = [s for s, v in zip(throttled.steps, throttled.values, strict=True) if v]
    if hot:
        at = dict(zip(clock.steps, clock.values, strict=True))
        fig.add_trace(th.scatter(x=hot, y=[100 * (at.get(s) or 0.0) for s in hot],
                                 name="throttled", mode="markers",
                                 marker={"color": "#E45756", "size": 7, "symbol": "x"},
                                 hovertemplate="throttled at step %{x}"))  # fmt: skip
    fig.update_layout(hovermode="x unified", xaxis=_STEP_AXIS,
                      yaxis={"title": {"text": "SM clock (% of max)"}, "rangemode": "tozero"})  # fmt: skip
    return fig


def host_busy(host: str, ranks: Sequence[HostRank], median: Series) -> go.Figure:
    """Busy time per step of each rank of one host, with the run's median rank (dashed)."""
    fig = th.figure(f"Busy time per rank on {th.text(host)} vs the median rank", height=420)
    for i, r in enumerate(sorted(ranks, key=lambda r: r.rank)):
        if r.busy:
            fig.add_trace(_line(r.busy, f"rank {r.rank}", {"color": th.color_for(i), "width": 1.5},
                                "%{y:.3~f} ms", 1e-3))  # fmt: skip
    if median:
        fig.add_trace(_line(median, "median rank (run)", {**_MEDIAN, "color": "#2d3436"},
                            "%{y:.3~f} ms", 1e-3))  # fmt: skip
    fig.update_layout(hovermode="x unified", xaxis=_STEP_AXIS,
                      yaxis={"title": {"text": "busy time per step (ms)"}, "rangemode": "tozero"})  # fmt: skip
    return fig


#: Charts of the rank view in page order: (id, full width?).
RANK_CHARTS = (
    ("steptime", True),
    ("parts", True),
    ("collectives", False),
    ("memory", False),
    ("training", True),
    ("gpu", True),
)
#: Charts of the node view.
HOST_CHARTS = (("busy", True),)


def rank_figures(view: RankView) -> dict[str, go.Figure]:
    """The rank view's charts that have data, by chart id (see RANK_CHARTS)."""
    out: dict[str, go.Figure] = {}
    if view.step_time or view.busy:
        out["steptime"] = step_time(view.rank, view.step_time, view.step_time_median,
                                    view.busy, view.busy_median)  # fmt: skip
    if view.parts or view.parts_run:
        out["parts"] = parts(view.rank, view.parts, view.parts_run)
    if any(view.latency.values()) or any(view.busbw.values()):
        out["collectives"] = collectives(view.latency, view.latency_median, view.busbw,
                                         view.busbw_median)  # fmt: skip
    if view.peaks or view.model_state:
        out["memory"] = memory(view.rank, view.peaks, view.peaks_median, view.model_state,
                               view.model_state_median)  # fmt: skip
    signals = [("gradient norm, pre-clip", view.grad_norm, view.grad_norm_median),
               ("loss", view.loss, view.loss_median),
               ("learning rate", view.lr, view.lr_median)]  # fmt: skip
    if any(mine or med for _, mine, med in signals):
        out["training"] = training(view.rank, signals)
    if view.gpu_clock:
        out["gpu"] = gpu(view.rank, view.gpu_clock, view.gpu_clock_median, view.gpu_throttled)
    return out


def host_figures(view: HostView) -> dict[str, go.Figure]:
    """The node view's charts that have data (see HOST_CHARTS)."""
    if not any(r.busy for r in view.ranks):
        return {}
    return {"busy": host_busy(view.host, view.ranks, view.busy_median)}


__all__ = [
    "HOST_CHARTS",
    "RANK_CHARTS",
    "HostRank",
    "HostView",
    "RankView",
    "collectives",
    "gpu",
    "gpu_text",
    "host_busy",
    "host_figures",
    "memory",
    "parts",
    "rank_figures",
    "ratio_to_median",
    "step_time",
    "training",
]
