"""The run page's memory waterfall: where a rank's device memory went, bar by bar, for the
median rank and the worst (zerowatch.waterfall: ZeRO theory -> measured model state ->
communication buffers -> activations -> allocator reserve). The crash finding carries the
same bars for the rank that ran out of memory, at that moment."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th

from zerowatch import waterfall as wf

#: How the bars read on the chart.
LABELS = {
    "theory": "ZeRO theory",
    "model_state": "model state (measured)",
    "comm_buffers": "communication buffers (planned)",
    "activations": "activations",
    "allocator_reserve": "allocator reserve + fragmentation",
}


def memory_waterfall(ranks: Mapping[str, Mapping[str, Any]]) -> go.Figure:
    """One group of bars per rank shown ("median rank", "worst rank"): each bar of
    zerowatch.waterfall in MiB or GiB; a bar that could not be measured (activations and
    the reserve on a CPU) is said in the title, not drawn as zero.

    Args:
        ranks: label -> that rank's waterfall (zerowatch.waterfall.waterfall).
    """
    values = [float(v) for bars in ranks.values() for k, v in bars.items()
              if k in wf.BARS and v is not None]  # fmt: skip
    top = max(values, default=0.0)
    unit, scale = ("GiB", float(th.GIB)) if top >= th.GIB else ("MiB", float(2**20))
    missing = sorted({LABELS[k] for bars in ranks.values() for k in wf.BARS
                      if bars.get(k) is None})  # fmt: skip
    title = "Memory waterfall: theory → model state → buffers → activations → reserve"
    if missing:
        title += f"<br><sup>not measured here: {', '.join(missing)}</sup>"
    fig = th.figure(title, height=380, barmode="group", legend=th.LEGEND_BELOW)
    for i, (label, bars) in enumerate(ranks.items()):
        names = [LABELS[k] for k in wf.BARS if bars.get(k) is not None]
        ys = [float(bars[k]) / scale for k in wf.BARS if bars.get(k) is not None]
        fig.add_trace(go.Bar(x=names, y=ys, name=label, marker={"color": th.color_for(i)},
                             hovertemplate=f"%{{x}}: %{{y:.4~f}} {unit}<extra>{label}</extra>"))  # fmt: skip
    capacity = next((b.get("capacity") for b in ranks.values() if b.get("capacity")), None)
    if capacity:
        fig.add_hline(y=float(capacity) / scale, line={"color": th.CAPACITY_COLOR, "dash": "dot"},
                      annotation_text="device capacity")  # fmt: skip
    fig.update_yaxes(title_text=unit)
    return fig


__all__ = ["LABELS", "memory_waterfall"]
