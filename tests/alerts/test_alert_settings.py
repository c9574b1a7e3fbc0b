"""AlertSettings: defaults, files, `key=value` overrides, and errors that name the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner
from zerowatch.alerts import AlertSettings, Duration, SettingsError, render_rules
from zerowatch.alerts.settings import field_docs

from zerowatch.cli import app


def test_defaults_are_the_documented_production_values() -> None:
    s = AlertSettings()
    assert s.window == "5m"
    assert s.step_time_regression_ratio == 1.10
    assert s.step_time_baseline_offset == "1h"
    assert s.step_time_regression_for == "10m"
    assert s.optimizer_step_for == "15m"
    assert s.grad_norm_spike_ratio == 10.0


def test_every_field_has_a_docstring() -> None:
    docs = field_docs()
    for f in dataclasses.fields(AlertSettings):
        assert len(docs.get(f.name, "")) > 20, f"{f.name} has no docstring"


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        AlertSettings().window = Duration("1m")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "canonical", "seconds"),
    [("5m", "5m", 300), ("300s", "5m", 300), ("90s", "1m30s", 90), ("1h30m", "1h30m", 5400),
     ("500ms", "500ms", 0.5), ("0s", "0s", 0), (15, "15s", 15), ("2.5", "2s500ms", 2.5)],
)  # fmt: skip
def test_durations_are_kept_in_prometheus_canonical_form(
    text: str | int, canonical: str, seconds: float
) -> None:
    d = Duration(text)
    assert d == canonical
    assert d.seconds == seconds


def test_yaml_file_then_overrides_in_that_order(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yml"
    f.write_text("stall_after: 10m\nstraggler_ratio: 1.5\nwindow: 120s\n")
    s = AlertSettings.load(f, ["straggler_ratio=1.3", "stall_for = 2m"])
    assert s.stall_after == "10m"
    assert s.straggler_ratio == 1.3  # the override wins over the file
    assert s.stall_for == "2m"
    assert s.window == "2m"
    assert isinstance(s.straggler_ratio, float)


def test_json_file(tmp_path: Path) -> None:
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps({"memory_headroom_ratio": 0.95, "optimizer_step_for": "20m"}))
    s = AlertSettings.load(f, [])
    assert s.memory_headroom_ratio == 0.95
    assert s.optimizer_step_for == "20m"


def test_no_file_no_overrides_is_the_defaults() -> None:
    assert AlertSettings.load(None, []) == AlertSettings()


def test_unknown_key_suggests_the_closest_setting(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"'stall_afer'.*did you mean 'stall_after'"):
        AlertSettings.load(None, ["stall_afer=10m"])
    f = tmp_path / "s.yml"
    f.write_text("step_time_regresion_ratio: 1.2\n")
    with pytest.raises(SettingsError, match=r"s\.yml.*did you mean 'step_time_regression_ratio'"):
        AlertSettings.load(f, [])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "step_time_regression_ratio=fast",
            r"step_time_regression_ratio: expected a number, got 'fast'",
        ),
        ("step_time_regression_ratio=0.9", r"step_time_regression_ratio: expected a number > 1"),
        ("grad_norm_spike_ratio=nan", r"grad_norm_spike_ratio: expected a finite number"),
        ("window=5 minutes", r"window: expected a duration like 30s, 5m or 1h30m, got '5 minutes'"),
        ("window=0s", r"window: expected a duration > 0"),
        ("memory_headroom_ratio=1.5", r"memory_headroom_ratio: expected a fraction in \(0, 1\]"),
        ("offload_bandwidth_ratio=1", r"offload_bandwidth_ratio: expected a fraction in \(0, 1\)"),
        (
            "all_gather_p99_threshold_seconds=-1",
            r"all_gather_p99_threshold_seconds: expected a number of seconds > 0",
        ),
        (
            "step_time_baseline_offset=1m",
            r"step_time_baseline_offset: expected a duration >= window \(5m\)",
        ),
        ("no_equals_sign", r"override 'no_equals_sign': expected key=value"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        AlertSettings.load(None, [override])


def test_bad_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        AlertSettings.load(tmp_path / "missing.yml", [])
    bad = tmp_path / "bad.yml"
    bad.write_text("window: [5m\n")
    with pytest.raises(SettingsError, match=r"bad\.yml: not valid YAML or JSON"):
        AlertSettings.load(bad, [])
    listing = tmp_path / "list.yml"
    listing.write_text("- window\n")
    with pytest.raises(SettingsError, match="expected a mapping"):
        AlertSettings.load(listing, [])
    typed = tmp_path / "typed.yml"
    typed.write_text("straggler_ratio: true\n")
    with pytest.raises(SettingsError, match="straggler_ratio: expected a number, got True"):
        AlertSettings.load(typed, [])


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(SettingsError, match="straggler_ratio"):
        AlertSettings(straggler_ratio=0.5)
    assert AlertSettings(window="30s").window == "30s"  # type: ignore[arg-type]


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


def test_cli_renders_with_overrides_and_rejects_bad_keys(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "rules.yml"
    result = runner.invoke(
        app, ["alerts", "render", "--out", str(out), "--set", "step_time_regression_ratio=1.25"]
    )
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text == render_rules(AlertSettings(step_time_regression_ratio=1.25))
    assert "> 1.25" in text

    result = runner.invoke(app, ["alerts", "render", "--set", "stall_afer=1m"])
    assert result.exit_code == 2
    assert "did you mean 'stall_after'" in result.output


def test_as_dict_round_trips_through_a_settings_file(tmp_path: Path) -> None:
    custom = AlertSettings(
        window=Duration("30s"), straggler_ratio=1.4, dashboard_url="http://zw:8321"
    )
    f = tmp_path / "s.yml"
    f.write_text(yaml.safe_dump(custom.as_dict()))
    assert AlertSettings.load(f, []) == custom


def test_dashboard_url_adds_a_link_to_the_run_page() -> None:
    s = AlertSettings.load(None, ["dashboard_url=https://zerowatch.example.org/"])
    assert s.dashboard_url == "https://zerowatch.example.org"
    groups = yaml.safe_load(render_rules(s))["groups"]
    links = {r["annotations"]["dashboard"] for g in groups for r in g["rules"] if "alert" in r}
    assert links == {"https://zerowatch.example.org/runs/{{ $labels.run | urlquery }}"}
    assert "dashboard" not in render_rules(AlertSettings())
    with pytest.raises(SettingsError, match="dashboard_url: expected empty or an http"):
        AlertSettings.load(None, ["dashboard_url=zerowatch:8321"])
