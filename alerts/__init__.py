"""zerowatch.alerts: Prometheus recording and alerting rules for ZeRO-sharded training.

`render_rules(AlertSettings.load(path, overrides))` renders the rule file; the shipped
`alerts/rules.yml` (RULES_PATH) is `render_rules(AlertSettings())`, and `alerts/tests/` holds
its `promtool test rules` unit tests. Imports nothing of zerowatch but the metric names in
zerowatch.events.
"""

from __future__ import annotations

from pathlib import Path

from .rules import ALERT_NAMES, render_rules
from .settings import AlertSettings, Duration, SettingsError

#: The shipped rule file: the rendered defaults.
RULES_PATH = Path(__file__).with_name("rules.yml")

__all__ = [
    "ALERT_NAMES",
    "RULES_PATH",
    "AlertSettings",
    "Duration",
    "SettingsError",
    "render_rules",
]
