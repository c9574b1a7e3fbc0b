"""Figures of the run page (`/runs/{id}`): each answers one question about one run.

- step_breakdown: where does a step's time go, and how much communication is exposed?
- collectives: is a collective getting slower, is its bus bandwidth where it should be?
- bandwidth_vs_size: are messages big enough to reach the link's bandwidth (nccl-tests view)?
- spread, phases (dashboards.spread): is the whole job slow or a few ranks, and in which
  phase?
- memory (dashboards.spread): how do the ranks' peaks sort against the ZeRO theory's
  model states and the device capacity?
- offload: is the host link the bottleneck of CPU offload?
- training: grad norm (clipping), loss, learning rate, loss scale and skipped steps.
- rank_heatmap: which rank holds the others back?

Every builder is a pure function of plain data (dashboards.data) returning a go.Figure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th
from zerowatch.dashboards.data import RankGrid, RunView, Series, SizePoints, Straggler
from zerowatch.dashboards.spread import add_bands, memory_by_rank, phase_spread, rank_spread
from zerowatch.dashboards.waterfall import memory_waterfall

from zerowatch import waterfall as wf
from zerowatch.events import PHASES, STEP_PARTS

_STEP_AXIS = {"title": {"text": "step"}}


#: The step-time charts' legend: up to nine entries (every part, the step time, hidden
#: communication) take two or three rows, which above the plot ran over the chart's title
#: at any page width; below the step axis they have the width to themselves.
_STEP_TIME_LEGEND = {**th.LEGEND_BELOW, "y": -0.2, "traceorder": "normal"}


def _time_per_step_figure(title: str) -> go.Figure:
    """An empty step-time chart: room below the step axis for its legend's rows (margins
    that start there spare the browser the second draw automargin would make)."""
    return th.figure(title, height=440, legend=_STEP_TIME_LEGEND,
                     margin={"l": 64, "r": 24, "t": 56, "b": 120})  # fmt: skip


def _time_per_step_layout(fig: go.Figure) -> go.Figure:
    fig.update_layout(
        hovermode="x unified",
        xaxis=_STEP_AXIS,
        yaxis={"title": {"text": "time per step (ms)"}, "rangemode": "tozero"},
    )
    return fig


def step_parts(step_time: Series, parts: Mapping[str, Series], hidden_comm: Series) -> go.Figure:
    """Step time per step stacked by its exclusive parts, with hidden communication beside.

    The parts (events.STEP_PARTS, means over ranks) never overlap and add up to the step,
    so the stack meets the step-time line (the mean over ranks too); the communication that
    compute hid is a dotted line beside the stack, not part of it.

    Args:
        step_time: mean step time over ranks, per step.
        parts: mean seconds per step of each part.
        hidden_comm: mean seconds per step of communication compute hid.
    """
    fig = _time_per_step_figure("Step time by part (mean over ranks)")
    for name in [p for p in STEP_PARTS if parts.get(p)]:
        series = parts[name]
        fig.add_trace(
            th.scatter(
                x=list(series.steps), y=th.scaled(series.values, 1e-3),
                name=th.PART_LABELS.get(name, th.text(name)), stackgroup="parts", mode="lines",
                line={"width": 0.5, "color": th.PART_COLORS.get(name)},
                hovertemplate="%{y:.3~f} ms",
            )
        )  # fmt: skip
    if step_time:
        fig.add_trace(
            th.scatter(x=list(step_time.steps), y=th.scaled(step_time.values, 1e-3),
                       name="step time", mode="lines", line={"color": "#2d3436", "width": 2},
                       hovertemplate="%{y:.3~f} ms")
        )  # fmt: skip
    if hidden_comm and any(v for v in hidden_comm.values if v):
        fig.add_trace(
            th.scatter(x=list(hidden_comm.steps), y=th.scaled(hidden_comm.values, 1e-3),
                       name="hidden communication (beside the stack)", mode="lines",
                       line={"color": th.EXPOSED_COLOR, "width": 2, "dash": "dot"},
                       hovertemplate="%{y:.3~f} ms (ran under compute)")
        )  # fmt: skip
    return _time_per_step_layout(fig)


def step_breakdown(
    step_time: Series, phases: Mapping[str, Series], exposed_comm: Series | None = None
) -> go.Figure:
    """Step time per step, stacked by phase, with the exposed communication marked: for runs
    whose agent reports no exclusive parts (see `step_parts`).

    Phases may overlap (the gradient reduce runs inside the backward under overlap_comm), so
    the stack can rise above the step-time line; where it stays below, the gap is shown as
    "other" so the stack always reaches the step time. Phases outside events.PHASES are drawn
    as dashed lines beside the stack, since they may nest inside one of it.

    Args:
        step_time: seconds per step (the whole step).
        phases: seconds per step for each phase in events.PHASES order (others after).
        exposed_comm: seconds of communication compute did not hide, per step.
    """
    fig = _time_per_step_figure("Step time by phase")
    by_step: dict[int, float] = {}
    for name in [p for p in PHASES if p in phases]:
        series = phases[name]
        if not series:
            continue
        for s, v in zip(series.steps, series.values, strict=True):
            by_step[s] = by_step.get(s, 0.0) + (v or 0.0)
        fig.add_trace(
            th.scatter(
                x=list(series.steps),
                y=th.scaled(series.values, 1e-3),
                name=th.phase_label(name),
                stackgroup="phases",
                mode="lines",
                line={"width": 0.5, "color": th.PHASE_COLORS.get(name)},
                hovertemplate="%{y:.3~f} ms",
            )
        )
    if step_time and by_step:
        # At the steps the stack has (a step without a step time is a gap of the line, but
        # a stacked area would fall to zero there).
        known = [(s, v) for s, v in zip(step_time.steps, step_time.values, strict=True)
                 if v is not None and s in by_step]  # fmt: skip
        other = [max(v - by_step[s], 0.0) for s, v in known]
        if any(o for o in other):
            fig.add_trace(
                th.scatter(
                    x=[s for s, _ in known],
                    y=th.scaled(other, 1e-3),
                    name=th.phase_label("other"),
                    stackgroup="phases",
                    mode="lines",
                    line={"width": 0.5, "color": th.PHASE_COLORS["other"]},
                    hovertemplate="%{y:.3~f} ms",
                )
            )
    for extra in sorted(p for p in phases if p not in PHASES and phases[p]):
        # A phase outside the vocabulary may nest inside a known one: a line, not the stack.
        fig.add_trace(
            th.scatter(x=list(phases[extra].steps), y=th.scaled(phases[extra].values, 1e-3),
                       name=th.phase_label(extra), mode="lines",
                       line={"width": 1.5, "dash": "dash"}, hovertemplate="%{y:.3~f} ms")
        )  # fmt: skip
    if step_time:
        fig.add_trace(
            th.scatter(
                x=list(step_time.steps),
                y=th.scaled(step_time.values, 1e-3),
                name="step time",
                mode="lines",
                line={"color": "#2d3436", "width": 2},
                hovertemplate="%{y:.3~f} ms",
            )
        )
    if exposed_comm:
        fig.add_trace(
            th.scatter(
                x=list(exposed_comm.steps),
                y=th.scaled(exposed_comm.values, 1e-3),
                name="exposed communication",
                mode="lines",
                line={"color": th.EXPOSED_COLOR, "width": 2, "dash": "dot"},
                hovertemplate="%{y:.3~f} ms (not hidden by compute)",
            )
        )
    return _time_per_step_layout(fig)


def collectives(
    latency: Mapping[str, Series],
    busbw: Mapping[str, Series],
    spread: Mapping[str, Mapping[str, Series]] | None = None,
) -> go.Figure:
    """Per collective op: latency per call (ms) and bus bandwidth (GB/s) over steps, the
    median rank's as a line in the op's colour, in its p10-p90 and min-max bands over ranks
    where `spread` holds them (a rank on a slow link widens the band's low side of the bus
    bandwidth).

    Args:
        latency: seconds per call, averaged over the step's calls, by op (median rank).
        busbw: nccl-tests bus bandwidth in bytes/s, by op (median rank).
        spread: `collective.<op>.latency_s` / `.busbw` -> stat -> Series, as RunView.spread.
    """
    fig = th.rows_figure(
        "Collectives over steps",
        ["latency per call: median rank, p10–p90 and min–max bands",
         "bus bandwidth: median rank, p10–p90 and min–max bands"], height=480,
        margin={"l": 64, "r": 24, "t": 90, "b": 48}, hovermode="x unified",
    )  # fmt: skip
    fig.update_layout(legend={"y": 1.1})
    for op in sorted(set(latency) | set(busbw)):
        color = th.OP_COLORS.get(op, "#4C78A8")
        for k, fld, scale in ((1, "latency_s", 1e-3), (2, "busbw", th.GB)):
            st = (spread or {}).get(f"collective.{op}.{fld}")
            if st:
                add_bands(fig, st, axes=th.panel_axes(k), scale=scale, color=color, group=op,
                          median=False, hover="")  # fmt: skip
    for op in sorted(set(latency) | set(busbw)):
        color = th.OP_COLORS.get(op)
        lat = latency.get(op)
        if lat:
            fig.add_trace(
                th.scatter(x=list(lat.steps), y=th.scaled(lat.values, 1e-3), name=th.op_label(op),
                           legendgroup=op, mode="lines", line={"color": color},
                           hovertemplate="%{y:.3~f} ms", **th.panel_axes(1))
            )  # fmt: skip
        bw = busbw.get(op)
        if bw:
            fig.add_trace(
                th.scatter(x=list(bw.steps), y=th.scaled(bw.values, th.GB), name=th.op_label(op),
                           legendgroup=op, showlegend=not lat, mode="lines",
                           line={"color": color}, hovertemplate="%{y:.3~f} GB/s",
                           **th.panel_axes(2))
            )  # fmt: skip
    fig.update_layout(
        yaxis={"title": {"text": "latency (ms)"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "bus bandwidth (GB/s)"}, "rangemode": "tozero"},
        xaxis2={"title": {"text": "step"}},
    )
    return fig


def bandwidth_vs_size(
    points: Mapping[str, SizePoints], ceiling_bytes_per_s: float | None = None
) -> go.Figure:
    """Bus bandwidth against message size per op (log size axis), as nccl-tests plots it;
    the machine's measured ceiling as a line where known.

    Args:
        points: per op, (bytes per call, bus bandwidth bytes/s) points.
        ceiling_bytes_per_s: the best bus bandwidth measured on this machine, if known.
    """
    fig = th.figure("Bus bandwidth vs message size", height=380)
    # The op with the most points first (underneath), the sparser on top of it; every op an
    # outline of its own shape (theme.OP_SYMBOLS), so that none hides another.
    for op in sorted(points, key=lambda o: (-len(points[o].sizes), o)):
        pts = points[op]
        if not pts.sizes:
            continue
        symbol = th.OP_SYMBOLS.get(op, th.OTHER_OP_SYMBOL)
        fig.add_trace(
            th.scatter(
                x=list(pts.sizes),
                y=th.scaled(pts.busbw, th.GB),
                name=th.op_label(op),
                mode="markers",
                marker={"color": th.OP_COLORS.get(op), "symbol": symbol, "size": 9,
                        "line": {"width": 1.5}},
                customdata=list(pts.steps) if pts.steps else None,
                text=[th.fmt_bytes(v) for v in pts.sizes],
                hovertemplate=(
                    "%{text} per call<br>%{y:.3~f} GB/s"
                    + ("<br>step %{customdata}" if pts.steps else "")
                ),
            )
        )  # fmt: skip
    if ceiling_bytes_per_s:
        fig.add_hline(
            y=ceiling_bytes_per_s / th.GB,
            line={"color": th.CAPACITY_COLOR, "dash": "dash"},
            annotation_text=f"measured ceiling {ceiling_bytes_per_s / th.GB:.3g} GB/s",
            annotation_position="top left",
        )
    fig.update_layout(
        xaxis={
            "title": {"text": "message size (bytes per call)"},
            "type": "log",
            **_size_axis([v for p in points.values() for v in p.sizes if v > 0]),
        },
        yaxis={"title": {"text": "bus bandwidth (GB/s)"}, "rangemode": "tozero"},
    )
    return fig


def _size_axis(sizes: Sequence[float]) -> dict[str, object]:
    """The log size axis labelled in bytes (theme.byte_ticks), over the sizes and a factor
    1.6 either side: wide enough to hold a 1-2-5 tick even where every call had one size."""
    if not sizes:
        return {}
    span = [math.log10(min(sizes) / 1.6), math.log10(max(sizes) * 1.6)]
    return {**th.byte_ticks(sizes, 1.0), "range": span, "autorange": False}


def offload(bandwidth: Mapping[str, Series]) -> go.Figure:
    """Host<->device copy bandwidth per direction over steps (GB/s)."""
    fig = th.figure("Offload bandwidth", height=320)
    for direction in sorted(bandwidth):
        s = bandwidth[direction]
        if not s:
            continue
        fig.add_trace(
            th.scatter(
                x=list(s.steps),
                y=th.scaled(s.values, th.GB),
                name=th.DIRECTION_LABELS.get(direction, th.text(direction)),
                mode="lines",
                line={"color": th.DIRECTION_COLORS.get(direction)},
                hovertemplate="%{y:.3~f} GB/s",
            )
        )
    fig.update_layout(
        hovermode="x unified",
        xaxis=_STEP_AXIS,
        yaxis={"title": {"text": "bandwidth (GB/s)"}, "rangemode": "tozero"},
    )
    return fig


def training(
    *,
    grad_norm: Series,
    loss: Series,
    lr: Series,
    loss_scale: Series | None = None,
    clipped_steps: Sequence[int] = (),
    skipped_steps: Sequence[int] = (),
) -> go.Figure:
    """Optimizer signals over steps, one panel each: grad norm (clipped steps marked), loss,
    learning rate, and loss scale with skipped (overflow) steps marked when fp16 scales.

    A marker that would fall on every drawn step (every step clipped) says nothing a note
    does not: the panel title says it instead. A constant series (a fixed learning rate)
    gets an axis centred on its value, not one from -0.5 to 1 that reads as zero."""
    every_clipped = _on_every_step(clipped_steps, grad_norm)
    every_skipped = _on_every_step(skipped_steps, loss_scale or Series())
    panels = [
        "gradient norm, pre-clip (every step clipped)" if every_clipped
        else "gradient norm, pre-clip (✕ clipped)" if clipped_steps
        else "gradient norm, pre-clip",
        "loss",
        "learning rate",
    ]  # fmt: skip
    if loss_scale or skipped_steps:
        panels.append("loss scale (every step skipped)" if every_skipped
                      else "loss scale (▼ skipped step)")  # fmt: skip
    n = len(panels)
    # The learning rate's ticks (1.0e−4) are wider than the base margin: starting wider
    # spares the second draw automargin would make.
    fig = th.rows_figure("Training signals", panels, height=170 * n + 80, gap=0.06,
                         showlegend=False, hovermode="x unified",
                         margin={"l": 76, "r": 24, "t": 56, "b": 48})  # fmt: skip

    def line(s: Series, k: int, name: str, color: str, hover: str, **kw: object) -> None:
        fig.add_trace(th.scatter(x=list(s.steps), y=list(s.values), name=name, mode="lines",
                                 line={"color": color, **kw}, hovertemplate=hover,
                                 **th.panel_axes(k)))  # fmt: skip

    line(grad_norm, 1, "grad norm", "#4C78A8", "%{y:.4~g}")
    if clipped_steps and not every_clipped:
        at = dict(zip(grad_norm.steps, grad_norm.values, strict=True))
        xs = [s for s in clipped_steps if at.get(s) is not None]
        fig.add_trace(
            th.scatter(x=xs, y=[at[s] for s in xs], name="clipped", mode="markers",
                       marker={"symbol": "x", "color": th.EXPOSED_COLOR, "size": 8},
                       hovertemplate="clipped at step %{x}", **th.panel_axes(1))
        )  # fmt: skip
    line(loss, 2, "loss", "#54A24B", "%{y:.4~f}")
    line(lr, 3, "learning rate", "#B279A2", "%{y:.3~e}")
    axes: dict[str, object] = {
        "yaxis": {"title": {"text": "norm"}, **_centred(grad_norm)},
        "yaxis2": {"title": {"text": "loss"}, **_centred(loss)},
        "yaxis3": {"title": {"text": "lr"}, "exponentformat": "e", **_centred(lr)},
        f"xaxis{n}": {"title": {"text": "step"}},
    }
    if n == 4:
        ls = loss_scale or Series()
        line(ls, 4, "loss scale", "#F58518", "%{y:.0f}", shape="hv")
        if skipped_steps and not every_skipped:
            at = dict(zip(ls.steps, ls.values, strict=True))
            fig.add_trace(
                th.scatter(x=list(skipped_steps), y=[at.get(s) or 1.0 for s in skipped_steps],
                           name="skipped step", mode="markers",
                           marker={"symbol": "triangle-down", "size": 9, "color": th.EXPOSED_COLOR},
                           hovertemplate="step %{x} skipped (overflow)", **th.panel_axes(4))
            )  # fmt: skip
        axes["yaxis4"] = {"title": {"text": "scale"}, "type": "log", "dtick": 1}
    fig.update_layout(axes)
    return fig


def _on_every_step(marked: Sequence[int], series: Series) -> bool:
    """Whether the marked steps cover every drawn step of `series` (and there are some)."""
    drawn = [s for s, v in zip(series.steps, series.values, strict=True) if v is not None]
    return bool(drawn) and set(drawn) <= set(marked)


def _centred(series: Series) -> dict[str, object]:
    """A y-range centred on a constant series' value (half of it either side; ±1 around
    zero); nothing for a series that varies (plotly's autorange reads it well)."""
    vals = [v for v in series.values if v is not None and math.isfinite(v)]
    if not vals or max(vals) - min(vals) > 1e-9 * max(abs(max(vals)), abs(min(vals)), 1e-300):
        return {}
    v = vals[0]
    half = abs(v) / 2 if v else 1.0
    return {"range": [v - half, v + half], "autorange": False}


def rank_heatmap(
    grid: RankGrid, found: Straggler | None, *, quantity: str = "busy time"
) -> go.Figure:
    """A time per rank (rows) over steps (columns); the title names the straggler the
    server's read model found (`found`), or says there is none. A wide run's rows are
    blocks of ranks (at most ~256 rows), each cell the block's maximum, as the title says.
    A click on a row opens the view of its rank with the most of the quantity (on a block,
    the rank that makes it stand out; `grid.links`, read by the page's script from
    `layout.meta`)."""
    b = grid.block
    title = f"{quantity.capitalize()} per rank" if b == 1 else (
        f"{quantity.capitalize()}, max over each block of {b} ranks (a click opens its slowest)"
    )  # fmt: skip
    if found is not None:
        title += f" — straggler: rank {found.rank} ({found.excess:+.0%} vs median rank)"
    else:
        title += " — no straggler"
    rows = [f"rank {r}" if b == 1 else f"ranks {r}-{r + b - 1}" for r in grid.ranks]
    # Margins that start where the row labels (~6.5 px a character, the axis title beside)
    # and the colour bar end: automargin would otherwise widen them and draw the chart twice.
    left = 30 + round(6.5 * max((len(r) for r in rows), default=0))
    fig = th.figure(title, height=max(240, min(640, 60 + 22 * len(grid.ranks))),
                    margin={"l": max(64, left), "r": 116, "t": 56, "b": 48})  # fmt: skip
    z = [th.scaled(row, 1e-3) for row in grid.z]
    fig.add_trace(
        th.heatmap(
            x=list(grid.steps),
            y=rows,
            z=z,
            colorscale="YlOrRd",
            colorbar={"title": {"text": "ms"}},
            hovertemplate="%{y}, step %{x}: %{z:.3~f} ms<extra></extra>",
        )
    )
    if found is not None:
        fig.add_annotation(
            x=1.0,
            xref="paper",
            xanchor="right",
            y=f"rank {found.rank}"
            if b == 1
            else f"ranks {found.rank // b * b}-{found.rank // b * b + b - 1}",
            text=f"◀ straggler rank {found.rank}",
            showarrow=False,
            font={"color": "#2d3436", "size": 12},
            bgcolor="rgba(255,255,255,0.8)",
        )
    fig.update_layout(xaxis=_STEP_AXIS, yaxis={"title": {"text": "rank"}, "autorange": "reversed"})
    if grid.links:
        fig.update_layout(meta={"rowLinks": list(grid.links)})
    return fig


#: Charts of the run page in page order: (id, full width?).
CHARTS = (
    ("breakdown", True),
    ("spread", True),
    ("phases", True),
    ("collectives", False),
    ("bandwidth", False),
    ("memory", False),
    ("waterfall", False),
    ("offload", False),
    ("training", False),
    ("ranks", True),
)


def figures(view: RunView) -> dict[str, go.Figure]:
    """The run page's charts that have data, by chart id (see CHARTS), in page order."""
    out: dict[str, go.Figure] = {}
    if view.parts:
        out["breakdown"] = step_parts(view.step_time_mean, view.parts, view.hidden_comm)
    elif view.step_time:
        out["breakdown"] = step_breakdown(view.step_time, view.phases, view.exposed_comm)
    wide = int(view.run.get("world_size", 1)) > 1
    if wide and any(view.spread.get(n) for n in ("busy_s", "step_time_s")):
        out["spread"] = rank_spread(view.spread)
    if wide and any(k.startswith("phase.") and v for k, v in view.spread.items()):
        out["phases"] = phase_spread(view.spread)
    if any(view.latency.values()) or any(view.busbw.values()):
        out["collectives"] = collectives(view.latency, view.busbw, view.spread)
    if any(p.sizes for p in view.sizes.values()):
        ceiling = view.run.get("engine_info", {}).get("busbw_ceiling_bytes_per_s")
        out["bandwidth"] = bandwidth_vs_size(
            view.sizes, float(ceiling) if isinstance(ceiling, (int, float)) else None
        )
    if view.memory_peak is not None:
        out["memory"] = memory_by_rank(
            view.memory_peak, view.memory_state, view.memory_phases, view.theory,
            stage=int(view.run.get("zero_stage", 0)), capacity_bytes=view.capacity_bytes,
        )  # fmt: skip
    if view.memory_peak is not None:
        out["waterfall"] = memory_waterfall(waterfall_by_rank(view))
    if any(view.offload.values()):
        out["offload"] = offload(view.offload)
    if view.grad_norm or view.loss or view.lr:
        out["training"] = training(
            grad_norm=view.grad_norm, loss=view.loss, lr=view.lr,
            loss_scale=view.loss_scale if view.loss_scale else None,
            clipped_steps=view.clipped_steps, skipped_steps=view.skipped_steps,
        )  # fmt: skip
    if view.heat.ranks and view.heat.steps:
        out["ranks"] = rank_heatmap(view.heat, view.straggler)
    return out


def waterfall_by_rank(view: RunView) -> dict[str, dict[str, Any]]:
    """The memory waterfall (zerowatch.waterfall) of the median rank and of the worst at the
    newest step that measured memory, from the stored rollups. The peak counts as the
    allocator's only where the agents reported a device capacity (a GPU); on a CPU it is
    the process's RSS and says nothing of activations."""
    run = view.run
    buffers = wf.comm_buffer_bytes(
        param_count=int(run.get("param_count") or 0), world_size=int(run.get("world_size", 1)),
        precision=str(run.get("precision", "fp32")), stage=int(run.get("zero_stage", 0)),
        zero_config=(run.get("config") or {}).get("zero_optimization"),
    )  # fmt: skip
    on_device = view.capacity_bytes is not None and view.memory_peak is not None
    values = view.memory_peak.values if view.memory_peak is not None else []
    peaks = (statistics.median(values), max(values)) if on_device and values else (None, None)
    reserved = view.memory_reserved or (None, None)
    capacity = int(view.capacity_bytes) if view.capacity_bytes else None
    out: dict[str, dict[str, Any]] = {}
    for label, peak, res in (("median rank", peaks[0], reserved[0]),
                             ("worst rank", peaks[1], reserved[1])):  # fmt: skip
        out[label] = wf.waterfall(
            theory=view.theory, model_state=view.memory_state, comm_buffers=buffers,
            peak_allocated=int(peak) if peak is not None else None,
            reserved=int(res) if res is not None else None, capacity=capacity,
        )  # fmt: skip
    return out


def missing_notes(view: RunView, drawn: dict[str, go.Figure]) -> list[str]:
    """Why a chart is absent, for the charts a run has no data for; and which drawn steps
    have no figures (`RunView.missing_steps`)."""
    notes = {
        "collectives": "No collectives recorded (a single rank communicates nothing).",
        "memory": "No memory measurements recorded.",
        "offload": "This run does not offload to the host (no host↔device copies).",
        "training": "No gradient norm, loss or learning rate recorded.",
    }
    if not view.steps:
        return []
    out = [text for key, text in notes.items() if key not in drawn]
    gone = view.missing_steps
    if gone:  # said, and drawn as gaps, not as lines across them
        out.insert(0, f"{len(gone):,} of the drawn steps ({gone[0]:,}–{gone[-1]:,}) have no "
                      "figures yet: still being rolled up (after an upload, for a minute or "
                      "so: reload) or never stored. The lines leave them out.")  # fmt: skip
    return out


__all__ = [
    "CHARTS",
    "bandwidth_vs_size",
    "collectives",
    "figures",
    "memory_by_rank",
    "memory_waterfall",
    "missing_notes",
    "offload",
    "phase_spread",
    "rank_heatmap",
    "rank_spread",
    "step_breakdown",
    "training",
    "waterfall_by_rank",
]
