"""Page assembly: figures and plain data into HTML, through Jinja2 templates that escape
every value (autoescape on), with plotly.js and the page script served by the server.

Figures travel to the browser as JSON inside `<script type="application/json">`, read with
`JSON.parse(textContent)`; `script_json` escapes `<`, `>` and `&` as `\\u003c`... so that no
data string can close the script element. Labels inside figures are escaped for Plotly by
the builders (theme.text).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2
import plotly
import plotly.graph_objects as go
from plotly.utils import PlotlyJSONEncoder
from zerowatch.dashboards import compare
from zerowatch.dashboards import theme as th

#: Plotly config of every chart: responsive, no logo, no "edit in chart studio".
PLOT_CONFIG: dict[str, Any] = {"responsive": True, "displaylogo": False}

_SCRIPT_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


#: Significant digits of the numbers a page's figures carry: a chart is a few hundred pixels
#: high, so five digits (1 part in 100,000) draw and hover the same as seventeen, in about a
#: third of the bytes (most of a wide run page's weight is its traces' numbers).
DIGITS = 5
#: The arrays of a trace that hold its numbers.
_ARRAYS = ("x", "y", "z")


def _compact(values: Any) -> Any:
    """A trace's array with its floats cut to DIGITS significant digits (nested for z)."""
    if isinstance(values, (list, tuple)):
        return [_compact(v) for v in values]
    if hasattr(values, "tolist"):  # an array of objects (numbers and None) plotly kept as is
        return _compact(values.tolist())
    if isinstance(values, float) and math.isfinite(values):
        return float(f"{values:.{DIGITS}g}")
    return values


def figure_dict(fig: go.Figure) -> dict[str, Any]:
    """A figure as the plain {data, layout} dict Plotly.newPlot / Plotly.react take, its
    traces' numbers cut to DIGITS significant digits."""
    # Plotly's own deep copy; what JSON lacks (NaN, numpy scalars) `script_json` encodes.
    out: dict[str, Any] = fig.to_plotly_json()
    data = out.get("data", [])
    for trace in data:
        for key in _ARRAYS:
            if key in trace and not isinstance(trace[key], (str, dict)):
                trace[key] = _compact(trace[key])
        err = trace.get("error_y")
        if isinstance(err, dict):
            for key in ("array", "arrayminus"):
                if key in err and not isinstance(err[key], (str, dict)):
                    err[key] = _compact(err[key])
    return {"data": data, "layout": out.get("layout", {})}


def script_json(value: Any) -> str:
    """JSON safe to embed inside a `<script type="application/json">` element."""
    # PlotlyJSONEncoder writes NaN and infinities as null (JSON has neither).
    text = json.dumps(value, cls=PlotlyJSONEncoder, separators=(",", ":"))
    for char, escaped in _SCRIPT_ESCAPES.items():
        text = text.replace(char, escaped)
    return text


def figures_payload(figures: Mapping[str, go.Figure]) -> dict[str, dict[str, Any]]:
    """Chart id -> {data, layout}, in page order."""
    return {key: figure_dict(fig) for key, fig in figures.items()}


def _fmt_time(ts: float | None) -> str:
    if not ts or not math.isfinite(ts):
        return "–"
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja2 environment of the dashboards' templates (autoescape everywhere)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("zerowatch.dashboards", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        bytes=th.fmt_bytes,
        seconds=th.fmt_seconds,
        rate=th.fmt_rate,
        time=_fmt_time,
        script_json=lambda v: jinja2.utils.markupsafe.Markup(script_json(v)),
        differences=compare.differences,
    )
    # plotly's version in the script URL: browsers cache plotly.js, and an upgrade changes it.
    env.globals.update(status_colors=th.STATUS_COLORS, plot_config=PLOT_CONFIG,
                       plotly_version=plotly.__version__)  # fmt: skip
    return env


def render(template: str, **context: Any) -> str:
    """Render one page template with its context."""
    return environment().get_template(template).render(**context)


__all__ = [
    "DIGITS",
    "PLOT_CONFIG",
    "environment",
    "figure_dict",
    "figures_payload",
    "render",
    "script_json",
]
