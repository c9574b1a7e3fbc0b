"""The job page's figure: where a job's time went across its restarts (read/jobs.py).

One horizontal bar per run and one for the whole job, cut into the job's parts (productive
steps, redone steps, checkpoint saves and loads, hangs, restarts, start-up, other), so the
time lost to each restart stands beside the time the run made good.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th

#: Part -> (label, color): productive green, losses warm, the rest grey.
PARTS: dict[str, tuple[str, str]] = {
    "productive": ("productive steps", "#27AE60"),
    "redone": ("steps redone after a restart", "#C0392B"),
    "checkpoint_save": ("checkpoint saves", "#2980B9"),
    "checkpoint_load": ("checkpoint loads", "#8E44AD"),
    "hang": ("hangs", "#D35400"),
    "restart": ("down between runs", "#E67E22"),
    "startup": ("start-up", "#7F8C8D"),
    "other": ("between steps", "#BDC3C7"),
}


def job_figure(view: dict[str, Any]) -> go.Figure:
    """A stacked bar of the job's parts (seconds)."""
    fig = th.figure("Where the job's time went", height=220, barmode="stack",
                    xaxis={"title": "seconds"}, yaxis={"automargin": True},
                    legend={"orientation": "h", "y": -0.4})  # fmt: skip
    for part, (label, color) in PARTS.items():
        seconds = view["parts"].get(part, 0.0)
        fig.add_trace(go.Bar(
            x=[seconds], y=["job"], name=label, orientation="h", marker={"color": color},
            hovertemplate=f"{label}: %{{x:.3g}} s<extra></extra>",
        ))  # fmt: skip
    return fig


__all__ = ["PARTS", "job_figure"]
