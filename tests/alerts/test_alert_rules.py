"""The rendered rules: the shipped file is current, promtool accepts it, and the promtool
unit tests in alerts/tests/ pass and cover every alert firing and not firing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from zerowatch.alerts import ALERT_NAMES, RULES_PATH, AlertSettings, render_rules
from zerowatch.alerts.settings import field_docs

ALERTS_DIR = RULES_PATH.parent
UNIT_TESTS = sorted((ALERTS_DIR / "tests").glob("*.yml"))
DOCS = Path(__file__).resolve().parents[2] / "docs" / "alerts.md"

#: Short windows, as an operator (or the end-to-end test) would render them.
SHORT = AlertSettings.load(
    None,
    [
        "window=6s", "step_time_baseline_offset=12s", "step_time_regression_for=2s",
        "stall_after=5s", "stall_for=1s", "grad_norm_baseline_window=20s",
        "offload_bandwidth_baseline_window=30s", "loss_scale_drop_window=10s",
        "nonfinite_window=10s",
    ],
)  # fmt: skip


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: install the Debian package `prometheus` (.ci/system-deps)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def rule_groups(text: str) -> list[dict]:
    return list(yaml.safe_load(text)["groups"])


def test_shipped_rule_file_is_the_rendered_default() -> None:
    assert RULES_PATH.read_text() == render_rules(AlertSettings()), (
        "alerts/rules.yml is stale: run `zerowatch alerts render --out alerts/rules.yml`"
    )


@pytest.mark.parametrize(
    "settings",
    [AlertSettings(), SHORT, AlertSettings(dashboard_url="https://zw.example.org")],
    ids=["default", "short", "dashboard"],
)
def test_promtool_check_rules_passes(settings: AlertSettings, tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(render_rules(settings))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout)


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS)


def test_every_alert_has_unit_tests_that_fire_it_and_that_must_not() -> None:
    fires: dict[str, int] = {}
    silent: dict[str, int] = {}
    for path in UNIT_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../rules.yml"], f"{path.name} must test the shipped rules"
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                name = case["alertname"]
                target = fires if case.get("exp_alerts") else silent
                target[name] = target.get(name, 0) + 1
                for exp in case.get("exp_alerts") or []:
                    assert {"severity", "run", "project"} <= exp["exp_labels"].keys()
                    assert {"summary", "description"} <= exp["exp_annotations"].keys()
    for name in ALERT_NAMES:
        assert fires.get(name), f"no promtool unit test fires {name}"
        assert silent.get(name, 0) >= 2, f"{name} needs 'not yet' and 'must not fire' cases"


def test_a_broken_threshold_fails_the_unit_tests(tmp_path: Path) -> None:
    """The unit tests pin the thresholds: rules rendered with another ratio fail them."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules.yml").write_text(render_rules(AlertSettings(step_time_regression_ratio=1.6)))
    test_file = tmp_path / "tests" / "step_time_regression.yml"
    shutil.copy(ALERTS_DIR / "tests" / "step_time_regression.yml", test_file)
    result = promtool("test", "rules", str(test_file))
    assert result.returncode != 0
    assert "ZeroWatchStepTimeRegression" in result.stdout + result.stderr


def test_every_alert_names_its_run_and_has_severity_and_annotations() -> None:
    groups = rule_groups(RULES_PATH.read_text())
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert tuple(alerts) == ALERT_NAMES
    assert set(ALERT_NAMES) == {
        "ZeroWatchStepTimeRegression", "ZeroWatchOptimizerStepSlow", "ZeroWatchAllGatherP99High",
        "ZeroWatchGradNormSpike", "ZeroWatchRunStalled", "ZeroWatchStragglerRank",
        "ZeroWatchMemoryHeadroomLow", "ZeroWatchOffloadBandwidthLow",
        "ZeroWatchLossScaleCollapse", "ZeroWatchNonFiniteLoss", "ZeroWatchGpuThrottled",
        "ZeroWatchGpuErrors", "ZeroWatchCollectiveHang", "ZeroWatchCheckpointSlow",
    }  # fmt: skip
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        notes = rule["annotations"]
        assert "{{ $labels.run }}" in notes["summary"], name
        assert "{{ $labels.run }}" in notes["description"], name
        assert "look at" in notes["description"].lower(), name
    # The one alert about a named rank; the others speak of a run (the server exposes
    # rank statistics, and per-rank series only for its outlier ranks).
    assert "{{ $labels.rank }}" in alerts["ZeroWatchStragglerRank"]["annotations"]["summary"]


def test_recording_rules_come_before_the_alert_that_reads_them() -> None:
    """Within a group Prometheus evaluates in order, so the alert sees this evaluation's
    recorded values; every recorded series an alert reads is recorded in its own group."""
    for group in rule_groups(RULES_PATH.read_text()):
        records = [r["record"] for r in group["rules"] if "record" in r]
        *head, last = group["rules"]
        assert "alert" in last and all("record" in r for r in head), group["name"]
        used = set(re.findall(r"zerowatch:[a-z0-9_:]+", last["expr"]))
        assert used <= set(records), (group["name"], used - set(records))


def test_windows_and_thresholds_come_from_the_settings() -> None:
    text = render_rules(SHORT)
    assert "zerowatch:step_time_seconds:avg6s" in text
    assert "[6s] offset 12s" in text
    assert "time() - zerowatch:run_last_event_timestamp_seconds:max > 5 " in text
    rules = {r.get("alert"): r for g in rule_groups(text) for r in g["rules"]}
    assert rules["ZeroWatchStepTimeRegression"]["for"] == "2s"
    assert rules["ZeroWatchRunStalled"]["for"] == "1s"
    assert "for" not in rules["ZeroWatchGradNormSpike"]  # 0s: fire at once
    default = render_rules(AlertSettings())
    assert "[5m] offset 1h" in default and "6s" not in default


def test_rendering_is_deterministic() -> None:
    assert render_rules(SHORT) == render_rules(SHORT)
    assert render_rules() == render_rules(AlertSettings())


def test_docs_describe_every_alert_and_setting() -> None:
    text = DOCS.read_text()
    for name in ALERT_NAMES:
        assert f"## {name}" in text, name
    for field in field_docs():
        assert f"`{field}`" in text, field
