"""zerowatch.dashboards: Plotly figure builders, one module a page, and page assembly.

- `run`, `compare`, `plan`: pure functions from plain data (`data`) to `go.Figure`.
- `theme`: colours, layout, units and the escaping of data shown inside charts.
- `html`: Jinja2 templates (autoescaped) and the JSON that carries figures to the browser.
- `grafana/zerowatch.json`: the same views for Prometheus users, over `/metrics`.

Imports nothing of zerowatch but `events` and `theory`: the server uses these builders; they
never use the server.
"""

from zerowatch.dashboards import compare, data, plan, run, theme

__all__ = ["compare", "data", "plan", "run", "theme"]
