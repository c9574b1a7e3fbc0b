"""Figures of a run's distribution over its ranks, drawn the same for 2 ranks as for 4,096:

- rank_spread: per step, is the whole job slow or a few ranks (busy, step, exposed
  communication time)?
- phase_spread: the same for each phase of the step: which phase do the slow ranks lose
  time in?
- memory_by_rank: how do the ranks' memory peaks sort, against the ZeRO theory's model
  states and the device's capacity?

A distribution per step is three things drawn together (`add_bands`): the median rank as a
line, in a p10-p90 band, in a min-max band, all from the rollups (the cost of a chart
follows the steps drawn, not the ranks). One slow rank widens the top of the min-max band;
a slow node moves the p90 too.

Every builder is a pure function of plain data (dashboards.data) returning a go.Figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th
from zerowatch.dashboards.data import Quantiles, RankDistribution, Series

from zerowatch.events import PHASES

#: The band colour of quantities without one of their own.
BAND_COLOR = "#4C78A8"
#: Stats a distribution per step holds (the rollups').
STATS = ("min", "p10", "p50", "p90", "max")


def add_bands(
    fig: go.Figure,
    st: Mapping[str, Series],
    *,
    axes: Mapping[str, str],
    scale: float,
    hover: str,
    color: str = BAND_COLOR,
    group: str = "",
    legend: bool = False,
    median: bool = True,
    name: str = "median rank",
) -> None:
    """Draw a distribution per step on one panel: min-max band, p10-p90 band, median line.

    Args:
        st: stat ("min", "p10", "p50", "p90", "max") -> Series over steps.
        axes: the panel's trace axes (theme.panel_axes).
        scale: the values are divided by it (1e-3: seconds drawn in ms).
        hover: the median's hover format (e.g. "%{y:.3~f} ms").
        color: the bands' and (when it is not the default) the median line's colour.
        group: legend group; the bands and line toggle together with it.
        legend: whether these traces show in the legend (once per figure).
        median: whether to draw the median line (a chart may draw its own).
        name: the median line's legend name.
    """
    for lo, hi, label, alpha in (("min", "max", "min–max over ranks", 0.13),
                                 ("p10", "p90", "p10–p90 over ranks", 0.3)):  # fmt: skip
        if not st.get(lo) or not st.get(hi):
            continue
        fig.add_trace(th.scatter(x=list(st[lo].steps), y=th.scaled(st[lo].values, scale),
                                 mode="lines", line={"width": 0}, showlegend=False,
                                 legendgroup=group or label, hoverinfo="skip", **axes))  # fmt: skip
        fig.add_trace(th.scatter(x=list(st[hi].steps), y=th.scaled(st[hi].values, scale),
                                 mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor=th.rgba(color, alpha), name=label,
                                 legendgroup=group or label, showlegend=legend,
                                 hoverinfo="skip", **axes))  # fmt: skip
    if median and st.get("p50"):
        line = {"color": "#2d3436" if color == BAND_COLOR else color, "width": 2}
        fig.add_trace(th.scatter(x=list(st["p50"].steps), y=th.scaled(st["p50"].values, scale),
                                 mode="lines", name=name, legendgroup=group or "median",
                                 showlegend=legend, line=line, hovertemplate=hover,
                                 **axes))  # fmt: skip


#: The time panels of rank_spread: metric -> panel title.
SPREAD_PANELS = {
    "busy_s": "busy time (step − exposed communication)",
    "step_time_s": "step time",
    "exposed_comm_s": "exposed communication (not hidden by compute)",
}


def rank_spread(spread: Mapping[str, Mapping[str, Series]]) -> go.Figure:
    """The distribution over ranks per step of busy time, step time and exposed
    communication: the median line in a p10-p90 band in a min-max band."""
    names = [n for n in SPREAD_PANELS if spread.get(n)]
    fig = th.rows_figure("Ranks over steps: median, p10–p90, min–max",
                         [SPREAD_PANELS[n] for n in names], height=180 * len(names) + 90,
                         gap=0.3 / len(names), showlegend=True,
                         hovermode="x unified")  # fmt: skip
    for k, name in enumerate(names, start=1):
        add_bands(fig, spread[name], axes=th.panel_axes(k), scale=1e-3, legend=k == 1,
                  hover="median %{y:.3~f} ms")  # fmt: skip
        fig.update_layout({f"yaxis{'' if k == 1 else k}": {"title": {"text": "ms"},
                                                           "rangemode": "tozero"}})  # fmt: skip
    fig.update_layout({f"xaxis{len(names)}": {"title": {"text": "step"}}})
    return fig


def phase_spread(spread: Mapping[str, Mapping[str, Series]]) -> go.Figure:
    """Each phase's time per step over ranks (median, p10-p90, min-max), one panel a phase
    in two columns: the phase whose top band widens is where slow ranks lose their time.
    Phases outside events.PHASES follow the known ones."""
    known = [p for p in PHASES if spread.get(f"phase.{p}")]
    extra = sorted(k.removeprefix("phase.") for k in spread
                   if k.startswith("phase.") and k.removeprefix("phase.") not in PHASES
                   and spread[k])  # fmt: skip
    phases = known + extra
    fig = th.grid_figure("Phases over ranks: median, p10–p90, min–max (ms per step)",
                         [th.phase_label(p) for p in phases], cols=2, row_height=170,
                         showlegend=True, hovermode="x unified")  # fmt: skip
    for k, phase in enumerate(phases, start=1):
        color = th.PHASE_COLORS.get(phase, BAND_COLOR)
        add_bands(fig, spread[f"phase.{phase}"], axes=th.panel_axes(k), scale=1e-3,
                  color=color, group=phase, legend=False, hover="median %{y:.3~f} ms",
                  name=f"{th.phase_label(phase)}, median rank")  # fmt: skip
        fig.update_layout({f"yaxis{'' if k == 1 else k}": {"rangemode": "tozero"}})
    # One legend entry says what the three layers are (every panel draws them alike).
    for label, alpha in (("median rank", None), ("p10–p90 over ranks", 0.3),
                         ("min–max over ranks", 0.13)):  # fmt: skip
        fig.add_trace(th.scatter(x=[None], y=[None], mode="lines", name=label,
                                 line={"color": "#636e72", "width": 2 if alpha is None else 8},
                                 opacity=1.0 if alpha is None else alpha * 2,
                                 hoverinfo="skip"))  # fmt: skip
    return fig


def _unit(values: Sequence[float]) -> tuple[str, float, bool]:
    """(unit, scale, log axis?) for byte values: GiB from 1 GiB up, MiB below; a log axis
    where the highest is 20x the lowest (a CPU run's RSS dwarfs its model states)."""
    top = max(values, default=0.0)
    low = min((v for v in values if v > 0), default=0.0)
    unit, scale = ("GiB", float(th.GIB)) if top >= th.GIB else ("MiB", float(2**20))
    return unit, scale, low > 0 and top / low > 20


def memory_by_rank(
    peak: RankDistribution,
    state: Mapping[str, float],
    phases: Mapping[str, Quantiles],
    theory: Mapping[str, float],
    *,
    stage: int,
    capacity_bytes: float | None = None,
) -> go.Figure:
    """Memory over ranks at one step: the ranks' peaks sorted (left) next to lines for the
    model states the median rank holds, the ZeRO theory's model states and the device
    capacity; each phase's peak over ranks (right: the median rank's bar, whiskers to the
    lowest and highest rank).

    A sorted distribution reads the same at any world size (no bar per rank, no rank labels
    to overlap): the highest ranks sit at the right end, named in the hover. Where the
    rollups hold only the ends of a wide run, the p10, median and p90 are drawn between
    them, as the title says. Kinds prefixed `host_` (offloaded) do not count against the
    device. A capacity nobody reported is said on the chart, not drawn.

    Args:
        peak: the highest phase peak of each rank, sorted (RankDistribution).
        state: model-state bytes the median rank holds, by kind.
        phases: phase -> its peak over ranks.
        theory: kind -> model-state bytes per rank by zerowatch.theory.
        stage: ZeRO stage, for the labels.
        capacity_bytes: the device capacity the agents reported, or None.
    """
    device_state = sum(v for k, v in state.items() if not k.startswith("host_"))
    theory_device = sum(v for k, v in theory.items() if not k.startswith("host_"))
    values = [*peak.values, *(q.max for q in phases.values()), device_state, theory_device]
    unit, scale, log = _unit(values)
    top = max(values, default=0.0)
    title = f"Memory over ranks at step {peak.step}"
    if capacity_bytes is None:
        title += " — device capacity not reported by the agents"
    elif top < 0.1 * capacity_bytes:  # a line at 80 GiB would flatten peaks of a few MiB
        title += f" (device capacity {th.fmt_bytes(capacity_bytes)}, off the scale)"
    ranks = f"{peak.n:,} rank{'' if peak.n == 1 else 's'} sorted by peak"
    title += f"<br><sup>{ranks}" + ("" if peak.every_rank else (
        ": the 16 lowest and 16 highest, the p10, median and p90 between")) + "</sup>"  # fmt: skip
    # The phase names under the bars, turned, take ~165 px below and overhang ~65 px right:
    # margins that start there spare the browser the second draw automargin would make.
    fig = th.figure(title, height=460, legend={**th.LEGEND_BELOW, "y": -0.3},
                    margin={"l": 64, "r": 68, "t": 70, "b": 168})  # fmt: skip
    hover = f"%{{y:.4~f}} {unit}"
    left, right = {"xaxis": "x", "yaxis": "y"}, {"xaxis": "x2", "yaxis": "y2"}
    labels = [f"rank {r}" if r is not None else q
              for r, q in zip(peak.ranks, _quantile_names(peak), strict=True)]  # fmt: skip
    fig.add_trace(th.scatter(x=list(peak.positions), y=th.scaled(peak.values, scale),
                             text=labels, name="peak per rank (sorted)", mode="lines+markers",
                             line={"color": th.PHASE_COLORS["backward"], "width": 2},
                             marker={"size": 5}, hovertemplate=f"%{{text}}: {hover}<extra></extra>",
                             **left))  # fmt: skip
    ends = [0, max(peak.n - 1, 1)]

    def level(value: float, name: str, line: dict[str, object], detail: str = "") -> None:
        fig.add_trace(th.scatter(x=ends, y=[value / scale] * 2, name=name, mode="lines",
                                 line=line, hovertemplate=f"{hover}{detail}<extra>{name}</extra>",
                                 **left))  # fmt: skip

    if device_state:
        level(device_state, "model states held (median rank)",
              {"color": "#636e72", "dash": "dot", "width": 2})  # fmt: skip
    if theory_device:
        detail = "".join(f"<br>{th.kind_label(k)}: {th.fmt_bytes(v)}" for k, v in theory.items()
                         if v and not k.startswith("host_"))  # fmt: skip
        level(theory_device, f"ZeRO-{stage} theory: model states",
              {"color": th.THEORY_COLOR, "dash": "dash", "width": 2}, detail)  # fmt: skip
    if capacity_bytes is not None and top >= 0.1 * capacity_bytes:
        level(capacity_bytes, f"device capacity {th.fmt_bytes(capacity_bytes)}",
              {"color": th.CAPACITY_COLOR, "dash": "dot", "width": 2})  # fmt: skip
    order = [p for p in PHASES if p in phases] + sorted(set(phases) - set(PHASES))
    if order:
        qs = [phases[p] for p in order]
        fig.add_trace(go.Bar(
            x=[th.phase_label(p) for p in order], y=[q.p50 / scale for q in qs],
            error_y={"type": "data", "symmetric": False, "color": "#2d3436",
                     "array": [(q.max - q.p50) / scale for q in qs],
                     "arrayminus": [(q.p50 - q.min) / scale for q in qs]},
            marker={"color": [th.PHASE_COLORS.get(p, BAND_COLOR) for p in order]},
            name="peak by phase: median rank (whiskers: lowest, highest rank)",
            hovertemplate=f"median {hover}<extra>%{{x}}</extra>", _validate=th.VALIDATE, **right,
        ))  # fmt: skip
    axis_y = {"title": {"text": f"memory ({unit}{', log scale' if log else ''})"},
              "type": "log" if log else "linear",
              **(th.byte_ticks(values, scale) if log else {"rangemode": "tozero"})}  # fmt: skip
    fig.update_layout(
        xaxis={**th.AXIS_STYLE, "domain": [0.0, 0.64] if order else [0.0, 1.0],
               "title": {"text": "rank order (lowest peak to highest)"},
               "range": [-0.5, max(peak.n - 0.5, 1.5)], **_rank_ticks(peak.n)},
        yaxis={**th.AXIS_STYLE, **axis_y},
        xaxis2={**th.AXIS_STYLE, "domain": [0.72, 1.0], "anchor": "y2"},
        # Bars stand on zero: their axis stays linear when the peaks' axis turns log.
        yaxis2={**th.AXIS_STYLE, "anchor": "x2", "rangemode": "tozero"},
    )  # fmt: skip
    return fig


def _rank_ticks(n: int) -> dict[str, object]:
    """Ticks at whole rank positions only (0 and 1 for 2 ranks, never -0.5 or 0.5): a step
    of 1, 2 or 5 times a power of ten that leaves at most 10 ticks."""
    step = next(d for d in (m * 10**k for k in range(16) for m in (1, 2, 5)) if n / d <= 10)
    return {"tickmode": "linear", "tick0": 0, "dtick": step, "tickformat": ",d"}


def _quantile_names(dist: RankDistribution) -> list[str]:
    """The name of each point that is a quantile ("" for a rank's point)."""
    names = {10: "p10 over ranks", 50: "median rank", 90: "p90 over ranks"}
    out = []
    for pos, r in zip(dist.positions, dist.ranks, strict=True):
        q = round(100 * pos / max(dist.n - 1, 1))
        out.append("" if r is not None else names.get(q, f"p{q} over ranks"))
    return out


__all__ = ["SPREAD_PANELS", "add_bands", "memory_by_rank", "phase_spread", "rank_spread"]
