"""The look shared by every zerowatch chart: colours per phase / op / kind, the layout
template, unit formatting (zerowatch.units), and the escaping of data shown inside a chart.

Plotly renders a small subset of HTML in titles, legends and hover labels (`<b>`, `<br>`,
`<span style=...>`), and drops tags it does not know: a run named `<script>x</script>` would
show as `x`. Every string that comes from data (run names, tags, config values) goes through
`text()` first, which turns `<`, `>` and `&` into entities that Plotly prints literally.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

import plotly.graph_objects as go

from zerowatch.units import GB, GIB, fmt_bytes, fmt_rate, fmt_seconds

# -- colours ------------------------------------------------------------------------------

#: One colour per step phase; communication phases are warm, compute cool, host copies grey.
PHASE_COLORS: dict[str, str] = {
    "forward": "#4C78A8",
    "backward": "#72B7B2",
    "grad_reduce": "#F58518",
    "param_gather": "#E45756",
    "optimizer_step": "#54A24B",
    "offload_d2h": "#B279A2",
    "offload_h2d": "#9D755D",
    "other": "#BAB0AC",
}
#: The exclusive parts of a step (events.STEP_PARTS), coloured like the phase they are the
#: self time of.
PART_COLORS: dict[str, str] = {
    "forward_compute": PHASE_COLORS["forward"],
    "backward_compute": PHASE_COLORS["backward"],
    "optimizer_step": PHASE_COLORS["optimizer_step"],
    "exposed_param_gather": PHASE_COLORS["param_gather"],
    "exposed_grad_reduce": PHASE_COLORS["grad_reduce"],
    "exposed_offload": PHASE_COLORS["offload_d2h"],
    "other": PHASE_COLORS["other"],
}
PART_LABELS: dict[str, str] = {
    "forward_compute": "forward compute",
    "backward_compute": "backward compute",
    "optimizer_step": "optimizer step",
    "exposed_param_gather": "exposed parameter gather",
    "exposed_grad_reduce": "exposed gradient reduce",
    "exposed_offload": "exposed offload copies",
    "other": "other (outside the engine)",
}
PHASE_LABELS: dict[str, str] = {
    "forward": "forward",
    "backward": "backward",
    "grad_reduce": "gradient reduce",
    "param_gather": "parameter gather",
    "optimizer_step": "optimizer step",
    "offload_d2h": "offload device→host",
    "offload_h2d": "offload host→device",
    "other": "other (unattributed)",
}
OP_COLORS: dict[str, str] = {
    "all_gather": "#E45756",
    "reduce_scatter": "#F58518",
    "all_reduce": "#4C78A8",
    "broadcast": "#54A24B",
}
#: One marker a collective op, each open (an outline) and each a different shape: where
#: two ops share a message size and a bandwidth (a stage-3 step all-gathers and
#: reduce-scatters the same buckets), both marks show, one drawn through the other.
OP_SYMBOLS: dict[str, str] = {
    "all_gather": "circle-open",
    "reduce_scatter": "x-thin-open",
    "all_reduce": "diamond-open",
    "broadcast": "square-open",
}
OTHER_OP_SYMBOL = "triangle-up-open"
KIND_COLORS: dict[str, str] = {
    "params": "#4C78A8",
    "grads": "#F58518",
    "optimizer_states": "#54A24B",
    "master_weights": "#B279A2",
}
KIND_LABELS: dict[str, str] = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer_states": "optimizer states",
    "master_weights": "fp32 master weights",
}
DIRECTION_COLORS: dict[str, str] = {"d2h": "#B279A2", "h2d": "#9D755D"}
DIRECTION_LABELS: dict[str, str] = {"d2h": "device → host", "h2d": "host → device"}
STATUS_COLORS: dict[str, str] = {
    "running": "#2E86DE",
    "finished": "#27AE60",
    "failed": "#C0392B",
    "stalled": "#E67E22",
}
#: A qualitative palette for runs side by side and ranks.
SERIES_COLORS: tuple[str, ...] = (
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#EECA3B",
    "#BAB0AC",
)
EXPOSED_COLOR = "#C0392B"
THEORY_COLOR = "#222222"
CAPACITY_COLOR = "#C0392B"
FONT = "Inter, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"


def recent_stat(steps: int) -> str:
    """The statistic of a run's recent step time, as every surface names it (the pages'
    hints, the doctor's findings, `zerowatch doctor`): server/read/runs.py `recent`."""
    return f"median over the run's newest {steps} steps of each step's median rank"


def recent_label(steps: int) -> str:
    """What a run's recent step time and samples/s are, as every page names them: the
    server's one definition (server/read/runs.py `recent`, read/compare.py with the same
    window)."""
    return f"{recent_stat(steps)} (samples/s: of the whole job's)"


def color_for(index: int) -> str:
    """The `index`-th colour of the qualitative palette (cycles)."""
    return SERIES_COLORS[index % len(SERIES_COLORS)]


# -- escaping and labels --------------------------------------------------------------------


def text(value: object) -> str:
    """A data string made safe and literal inside a Plotly label (see the module docstring)."""
    return html.escape(str(value), quote=False)


def phase_label(phase: str) -> str:
    return PHASE_LABELS.get(phase, text(phase))


def kind_label(kind: str) -> str:
    return KIND_LABELS.get(kind, text(kind))


def op_label(op: str) -> str:
    return text(op.replace("_", "-"))


# -- units ---------------------------------------------------------------------------------
# One convention for the CLI, the pages and the charts: zerowatch.units (bytes binary, rates
# decimal). Re-exported here because every figure builder reads its units through `th.`.


def scaled(values: Iterable[float | None], factor: float) -> list[float | None]:
    """Values divided by `factor`, None kept (a gap in the line)."""
    return [None if v is None else v / factor for v in values]


# -- layout ---------------------------------------------------------------------------------


#: Axis look of every chart (plotly_white's grid): `base_layout`, `rows_figure`,
#: `grid_figure` and a page's extra axes spread it into each axis.
AXIS_STYLE: dict[str, object] = {
    "gridcolor": "#EBF0F8", "linecolor": "#EBF0F8", "zerolinecolor": "#EBF0F8",
    "zerolinewidth": 2, "automargin": True, "showline": False, "ticks": "",
}  # fmt: skip


def _axis_key(axis: str, k: int) -> str:
    return axis if k == 1 else f"{axis}{k}"


def rows_figure(
    title: str, panels: list[str], *, height: int, gap: float = 0.09, **layout: object
) -> go.Figure:
    """A figure of stacked panels sharing one step axis: panel k (1 = top) draws on axes
    `x{k}`/`y{k}` (`x`/`y` for the first), its title above it.

    Laid out by hand: plotly's make_subplots costs tens of milliseconds per figure, which a
    page of several charts, rebuilt on every live update, would pay each time.
    """
    n = len(panels)
    span = (1.0 - gap * (n - 1)) / n
    spec: dict[str, object] = {}
    annotations = []
    for k in range(1, n + 1):
        top = 1.0 - (k - 1) * (span + gap)
        spec[_axis_key("yaxis", k)] = {
            **AXIS_STYLE,
            "domain": [max(round(top - span, 6), 0.0), round(top, 6)],
            "anchor": f"x{k}" if k > 1 else "x",
        }
        spec[_axis_key("xaxis", k)] = {
            **AXIS_STYLE, "anchor": f"y{k}" if k > 1 else "y", "showticklabels": k == n,
            **({"matches": "x"} if k > 1 else {}),
        }  # fmt: skip
        annotations.append({"text": panels[k - 1], "x": 0.5, "xref": "paper", "xanchor": "center",
                            "y": top, "yref": "paper", "yanchor": "bottom", "showarrow": False,
                            "font": {"size": 13}})  # fmt: skip
    return go.Figure(layout={**base_layout(title, height=height), **spec, "annotations": annotations,
                             **layout}, _validate=VALIDATE)  # fmt: skip


def grid_figure(
    title: str, panels: list[str], *, cols: int, row_height: int, gap: float = 0.07,
    **layout: object,
) -> go.Figure:  # fmt: skip
    """A figure of panels in a grid of `cols` columns (filled row by row) sharing one step
    axis: panel k (1 = top left) draws on axes `x{k}`/`y{k}` (`panel_axes(k)`), its title
    above it; the bottom panel of each column shows the step ticks. Laid out by hand, as
    `rows_figure`."""
    n = len(panels)
    rows = max(1, -(-n // cols))
    height = row_height * rows + 90
    vgap = 50 / height  # room for a panel title, in paper units
    span_y = (1.0 - vgap * (rows - 1)) / rows
    span_x = (1.0 - gap * (cols - 1)) / cols
    spec: dict[str, object] = {}
    annotations = []
    for k in range(1, n + 1):
        r, c = divmod(k - 1, cols)
        top = 1.0 - r * (span_y + vgap)
        left = c * (span_x + gap)
        bottom_of_column = k + cols > n
        spec[_axis_key("yaxis", k)] = {
            **AXIS_STYLE, "anchor": f"x{k}" if k > 1 else "x",
            "domain": [max(round(top - span_y, 6), 0.0), round(top, 6)],
        }  # fmt: skip
        spec[_axis_key("xaxis", k)] = {
            **AXIS_STYLE, "anchor": f"y{k}" if k > 1 else "y", "showticklabels": bottom_of_column,
            "domain": [round(left, 6), min(round(left + span_x, 6), 1.0)],
            **({"matches": "x"} if k > 1 else {}),
        }  # fmt: skip
        annotations.append({"text": panels[k - 1], "x": left + span_x / 2, "xref": "paper",
                            "xanchor": "center", "y": top, "yref": "paper", "yanchor": "bottom",
                            "showarrow": False, "font": {"size": 13}})  # fmt: skip
    return go.Figure(layout={**base_layout(title, height=height), **spec,
                             "annotations": annotations, **layout}, _validate=VALIDATE)  # fmt: skip


def byte_ticks(values: Sequence[float], scale: float) -> dict[str, object]:
    """A log axis's ticks at 1, 2 and 5 KiB, MiB, GiB... (every tenth of them where they
    would crowd), labelled with their bytes ("200 MiB", "1 GiB"): plotly's own log ticks
    label 2 and 5 with the digit alone ("5 2 100 5 2 10"), which reads as numbers out of
    order. `values` are bytes; the axis draws them divided by `scale`."""
    shown = [v for v in values if v > 0]
    if not shown:
        return {}
    low, top = min(shown) / 2.5, max(shown) * 2.5
    marks = [(m, m * unit) for unit in (1, 2**10, 2**20, 2**30, 2**40, 2**50)
             for m in (1, 2, 5, 10, 20, 50, 100, 200, 500)]  # fmt: skip
    marks = [(m, b) for m, b in marks if low <= b <= top]
    if len(marks) > 10:
        marks = [(m, b) for m, b in marks if m in (1, 10, 100)]
    ticks = [b for _, b in marks]
    return {"tickmode": "array", "tickvals": [b / scale for b in ticks],
            "ticktext": [fmt_bytes(b) for b in ticks]}  # fmt: skip


def rgba(color: str, alpha: float) -> str:
    """A `#RRGGBB` colour with an opacity, as plotly takes it (`rgba(r,g,b,a)`)."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def panel_axes(k: int) -> dict[str, str]:
    """The trace properties that put a trace on panel k of a `rows_figure`."""
    return {"xaxis": "x" if k == 1 else f"x{k}", "yaxis": "y" if k == 1 else f"y{k}"}


def base_layout(title: str, *, height: int = 360, **extra: object) -> dict[str, object]:
    """The common layout: white background, light grid, legend on top, unified hover."""
    layout: dict[str, object] = {
        # plotly_white's look set directly: a named template costs a deep copy per figure.
        "template": "none",
        "colorway": list(SERIES_COLORS),
        "plot_bgcolor": "white",
        "xaxis": dict(AXIS_STYLE),
        "yaxis": dict(AXIS_STYLE),
        "title": {"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 15}},
        "font": {"family": FONT, "size": 12, "color": "#2d3436"},
        "height": height,
        "margin": {"l": 64, "r": 24, "t": 56, "b": 48},
        "legend": {
            "orientation": "h",
            "yanchor": "bottom",
            "y": 1.0,
            "x": 1.0,
            "xanchor": "right",
            "font": {"size": 11},
        },
        "hoverlabel": {"font": {"family": FONT}},
        "paper_bgcolor": "rgba(0,0,0,0)",
    }
    layout.update(extra)
    return layout


#: Legend below the plot, for charts whose legend would crowd their title.
LEGEND_BELOW: dict[str, object] = {
    "orientation": "h", "yanchor": "top", "y": -0.22, "x": 0.0, "xanchor": "left",
    "font": {"size": 11},
}  # fmt: skip


#: Whether plotly checks every property of the figures (`figure`, `rows_figure`,
#: `grid_figure`: what is added to them) and of the traces `scatter` and `heatmap` build.
#: It costs ~5 ms a trace, most of a wide run's page on the server (its bands are a hundred
#: traces), and checks only what the builders' own tests already pin: tests turn it on
#: (tests/dashboards/conftest.py), so a misspelt property still fails there. (Plotly's
#: `add_trace` coerces a trace's data arrays again either way: ~40 ms of the run page of
#: 32,768 steps, which no public plotly call skips.)
VALIDATE = False


def scatter(**props: object) -> go.Scatter:
    """A scatter trace, checked by plotly only when `VALIDATE` is on."""
    return go.Scatter(**props, _validate=VALIDATE)


def heatmap(**props: object) -> go.Heatmap:
    """A heatmap trace, checked by plotly only when `VALIDATE` is on."""
    return go.Heatmap(**props, _validate=VALIDATE)


def figure(title: str, *, height: int = 360, **layout: object) -> go.Figure:
    """An empty figure with the zerowatch layout."""
    return go.Figure(layout=base_layout(title, height=height, **layout), _validate=VALIDATE)


def finite(values: Sequence[float | None]) -> list[float]:
    """The finite values of a sequence."""
    return [v for v in values if v is not None and math.isfinite(v)]


__all__ = [
    "AXIS_STYLE",
    "CAPACITY_COLOR",
    "DIRECTION_COLORS",
    "DIRECTION_LABELS",
    "EXPOSED_COLOR",
    "GB",
    "GIB",
    "KIND_COLORS",
    "KIND_LABELS",
    "LEGEND_BELOW",
    "OP_COLORS",
    "OP_SYMBOLS",
    "OTHER_OP_SYMBOL",
    "PART_COLORS",
    "PART_LABELS",
    "PHASE_COLORS",
    "PHASE_LABELS",
    "SERIES_COLORS",
    "STATUS_COLORS",
    "THEORY_COLOR",
    "VALIDATE",
    "base_layout",
    "byte_ticks",
    "color_for",
    "figure",
    "finite",
    "fmt_bytes",
    "fmt_rate",
    "fmt_seconds",
    "grid_figure",
    "kind_label",
    "op_label",
    "panel_axes",
    "phase_label",
    "rgba",
    "rows_figure",
    "scaled",
    "scatter",
    "text",
]
