"""What the browser tests ask a page about its Plotly charts."""

from __future__ import annotations

from typing import Any

#: Per chart div: is it a Plotly plot, its traces and points, and how many trace elements
#: Plotly drew into the SVG (scatter and bar traces, heatmap images).
CHARTS_JS = """
() => Array.from(document.querySelectorAll('.chart')).map(div => ({
  id: div.id,
  plotted: div.classList.contains('js-plotly-plot'),
  traces: (div.data || []).length,
  points: (div.data || []).map(t => t.z ? t.z.length * (t.z[0] || []).length
                                        : (t.x || t.y || []).length),
  maxX: Math.max(...(div.data || []).flatMap(t => (t.x || []).filter(v => typeof v === 'number'))),
  drawn: div.querySelectorAll(
    '.scatterlayer .trace, .barlayer .trace, .heatmaplayer .hm image').length,
}))
"""

ALL_DRAWN_JS = """
() => {
  const divs = Array.from(document.querySelectorAll('.chart'));
  return divs.length > 0 && divs.every(d => d.classList.contains('js-plotly-plot')
    && (d.data || []).length > 0
    && d.querySelectorAll('.scatterlayer .trace, .barlayer .trace, .heatmaplayer .hm image').length > 0);
}
"""


def charts(page: Any) -> dict[str, dict[str, Any]]:
    """Chart id (without the `chart-` prefix) -> what CHARTS_JS reports."""
    return {c["id"].removeprefix("chart-"): c for c in page.evaluate(CHARTS_JS)}


def assert_all_drawn(page: Any, expected: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every chart on the page is a Plotly plot with traces that have points and were drawn."""
    page.wait_for_function(ALL_DRAWN_JS, timeout=15_000)
    got = charts(page)
    if expected is not None:
        assert set(got) == expected, f"charts {sorted(got)} != {sorted(expected)}"
    for cid, c in got.items():
        assert c["plotted"] and c["traces"] > 0, (cid, c)
        assert all(n > 0 for n in c["points"]), (cid, c)
        assert c["drawn"] > 0, (cid, c)
    return got
