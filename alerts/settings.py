"""The thresholds and windows of zerowatch's alert rules: one typed, frozen settings object.

An operator renders rules for their fleet with a YAML/JSON file of settings and `--set
key=value` overrides (`zerowatch alerts render --settings fleet.yml --set stall_after=10m`);
tests shrink every window to seconds the same way. Every field is checked when the object
is built, and every error names the field (and suggests the closest name for a typo).

Durations are Prometheus durations (`30s`, `5m`, `1h30m`, `500ms`), kept in canonical form
(`300s` becomes `5m`) so that the recording-rule names built from them are stable.
"""

# Duration is an immutable str, safe as a dataclass default:
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml


class SettingsError(ValueError):
    """A bad alert setting: unknown key, wrong type or out-of-range value (names the key)."""


# -- durations ----------------------------------------------------------------------------

_UNITS_MS = {"y": 365 * 86_400_000, "w": 7 * 86_400_000, "d": 86_400_000,
             "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}  # fmt: skip
_DURATION = re.compile(r"^(?:\d+(?:y|w|d|h|ms|m|s))+$")
_PART = re.compile(r"(\d+)(y|w|d|h|ms|m|s)")


class Duration(str):
    """A Prometheus duration string in canonical form (`5m`, `1h30m`, `0s`)."""

    __slots__ = ()

    def __new__(cls, text: str | int | float) -> Duration:
        ms = _parse_duration_ms(text)
        return super().__new__(cls, _format_duration_ms(ms))

    @property
    def seconds(self) -> float:
        return _parse_duration_ms(str(self)) / 1000.0


def _parse_duration_ms(text: str | int | float) -> int:
    """Milliseconds in a Prometheus duration; a bare number is seconds."""
    if isinstance(text, bool):
        raise ValueError(f"expected a duration like 30s or 5m, got {text!r}")
    if isinstance(text, int | float):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"expected a duration like 30s or 5m, got {text!r}")
        return round(text * 1000)
    s = str(text).strip()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return round(float(s) * 1000)
    if not _DURATION.match(s):
        raise ValueError(f"expected a duration like 30s, 5m or 1h30m, got {text!r}")
    return sum(int(n) * _UNITS_MS[u] for n, u in _PART.findall(s))


def _format_duration_ms(ms: int) -> str:
    """Prometheus' own canonical spelling: largest units first, `0s` for zero."""
    if ms == 0:
        return "0s"
    out = []
    for unit, size in _UNITS_MS.items():
        if ms >= size:
            out.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(out)


# -- the settings ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AlertSettings:
    """Every threshold and window of the rendered rules. Defaults suit a production fleet
    scraped every 15-30 s; tests and demos shrink the windows to seconds."""

    window: Duration = Duration("5m")
    """Averaging window of the recording rules (step time, busy time, optimizer step,
    offload bandwidth, all-gather p99 rate, non-finite step count): the "now" of every
    alert. Must span at least two scrapes."""

    step_time_regression_ratio: float = 1.10
    """ZeroWatchStepTimeRegression: fire when a run's step time averaged over `window` is
    more than this multiple of its baseline (> 1)."""

    step_time_baseline_offset: Duration = Duration("1h")
    """ZeroWatchStepTimeRegression: the baseline is the same `window` average this long
    earlier (a PromQL `offset`; at least `window`, so the two windows do not overlap)."""

    step_time_regression_for: Duration = Duration("10m")
    """ZeroWatchStepTimeRegression: how long the regression must hold before firing."""

    optimizer_step_threshold_seconds: float = 5.0
    """ZeroWatchOptimizerStepSlow: fire when the slowest rank's optimizer step, averaged
    over `window`, takes longer than this many seconds (CPU-offloaded Adam is the usual
    culprit)."""

    optimizer_step_for: Duration = Duration("15m")
    """ZeroWatchOptimizerStepSlow: how long the slow optimizer step must last."""

    all_gather_p99_threshold_seconds: float = 0.25
    """ZeroWatchAllGatherP99High: fire when the run's p99 all-gather latency over `window`
    (from the latency histogram) exceeds this many seconds."""

    all_gather_p99_for: Duration = Duration("10m")
    """ZeroWatchAllGatherP99High: how long the high p99 must last."""

    grad_norm_spike_ratio: float = 10.0
    """ZeroWatchGradNormSpike: fire when the run's gradient norm is more than this multiple
    of its average over `grad_norm_baseline_window` (> 1)."""

    grad_norm_baseline_window: Duration = Duration("30m")
    """ZeroWatchGradNormSpike: the window of the "recent average" gradient norm."""

    grad_norm_spike_for: Duration = Duration("0s")
    """ZeroWatchGradNormSpike: how long the spike must last (0s: fire at once; a spike is
    often a single step)."""

    stall_after: Duration = Duration("5m")
    """ZeroWatchRunStalled: a run still marked running whose newest event is older than
    this is stalled. Keep it under the job's NCCL/gloo timeout to hear of a hang before
    the job dies of it."""

    stall_for: Duration = Duration("1m")
    """ZeroWatchRunStalled: how long the stall must last before firing."""

    straggler_ratio: float = 1.2
    """ZeroWatchStragglerRank: fire when one rank's busy time (step time minus exposed
    communication, averaged over `window`) is more than this multiple of the median rank
    of its run (> 1)."""

    straggler_for: Duration = Duration("15m")
    """ZeroWatchStragglerRank: how long the rank must stay slow ("persistently")."""

    memory_headroom_ratio: float = 0.90
    """ZeroWatchMemoryHeadroomLow: fire when a rank's peak memory exceeds this fraction of
    its device's capacity (in (0, 1]); ranks whose capacity is unknown never fire."""

    memory_for: Duration = Duration("5m")
    """ZeroWatchMemoryHeadroomLow: how long the peak must stay that high."""

    offload_bandwidth_ratio: float = 0.5
    """ZeroWatchOffloadBandwidthLow: fire when a rank's offload bandwidth (per direction)
    averaged over `window` is below this fraction of its average over
    `offload_bandwidth_baseline_window` (in (0, 1))."""

    offload_bandwidth_baseline_window: Duration = Duration("1h")
    """ZeroWatchOffloadBandwidthLow: the window of the bandwidth's "own recent level"
    (longer than `window`)."""

    offload_bandwidth_for: Duration = Duration("10m")
    """ZeroWatchOffloadBandwidthLow: how long the low bandwidth must last."""

    loss_scale_floor: float = 1.0
    """ZeroWatchLossScaleCollapse: fire when a run's fp16 loss scale is at or below this
    value (DeepSpeed's default `min_loss_scale` is 1)."""

    loss_scale_drop_factor: float = 1024.0
    """ZeroWatchLossScaleCollapse: also fire when the loss scale has fallen by more than
    this factor below its maximum over `loss_scale_drop_window` (> 1; 1024 = ten
    consecutive overflow halvings)."""

    loss_scale_drop_window: Duration = Duration("15m")
    """ZeroWatchLossScaleCollapse: the window of that maximum."""

    loss_scale_for: Duration = Duration("1m")
    """ZeroWatchLossScaleCollapse: how long the collapse must last."""

    nonfinite_window: Duration = Duration("5m")
    """ZeroWatchNonFiniteLoss: fire when a run's count of non-finite steps grew within this
    window (or its latest loss is NaN or infinite)."""

    nonfinite_for: Duration = Duration("0s")
    """ZeroWatchNonFiniteLoss: how long before firing (0s: at once)."""

    gpu_throttled_min_ranks: float = 1.0
    """ZeroWatchGpuThrottled: fire when at least this many ranks of a run had a throttled
    GPU (NVML clock event reasons: power cap, thermal or hardware slowdown) at every scrape
    of `window` (>= 1)."""

    gpu_throttled_for: Duration = Duration("10m")
    """ZeroWatchGpuThrottled: how long the throttling must last."""

    gpu_errors_window: Duration = Duration("5m")
    """ZeroWatchGpuErrors: fire when a run's count of critical XID events or uncorrected
    ECC errors (summed over its ranks' GPUs) grew within this window."""

    gpu_errors_for: Duration = Duration("0s")
    """ZeroWatchGpuErrors: how long before firing (0s: at once)."""

    collective_hang_for: Duration = Duration("1m")
    """ZeroWatchCollectiveHang: how long the server must have named hung ranks (ranks not
    in the collective the others wait in, or silent) before firing."""

    checkpoint_save_threshold_seconds: float = 600.0
    """ZeroWatchCheckpointSlow: fire when a run's newest checkpoint save took its slowest
    rank longer than this many seconds."""

    dashboard_url: str = ""
    """Base URL of the zerowatch server as on-call engineers open it (e.g.
    `https://zerowatch.example.org`); when set, every alert gets a `dashboard` annotation
    linking to the run's page (`<dashboard_url>/runs/<run>`). Empty: no link."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(f.name, _FIELD_TYPES[f.name], value))
        self._check_ranges()

    def _check_ranges(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SettingsError(f"{name}: expected {what}, got {getattr(self, name)!r}")

        for name in ("step_time_regression_ratio", "grad_norm_spike_ratio",
                     "straggler_ratio", "loss_scale_drop_factor"):  # fmt: skip
            need(getattr(self, name) > 1.0, name, "a number > 1")
        for name in ("optimizer_step_threshold_seconds", "all_gather_p99_threshold_seconds",
                     "checkpoint_save_threshold_seconds"):  # fmt: skip
            need(getattr(self, name) > 0.0, name, "a number of seconds > 0")
        need(
            0.0 < self.memory_headroom_ratio <= 1.0, "memory_headroom_ratio", "a fraction in (0, 1]"
        )
        need(
            0.0 < self.offload_bandwidth_ratio < 1.0,
            "offload_bandwidth_ratio",
            "a fraction in (0, 1)",
        )
        need(self.loss_scale_floor >= 0.0, "loss_scale_floor", "a number >= 0")
        need(self.gpu_throttled_min_ranks >= 1.0, "gpu_throttled_min_ranks", "a number >= 1")
        need(
            not self.dashboard_url
            or re.fullmatch(r"https?://[^\s/{}]+[^\s{}]*", self.dashboard_url) is not None,
            "dashboard_url",
            "empty or an http(s):// URL",
        )
        for name in ("window", "step_time_baseline_offset", "grad_norm_baseline_window",
                     "stall_after", "offload_bandwidth_baseline_window",
                     "loss_scale_drop_window", "nonfinite_window",
                     "gpu_errors_window"):  # fmt: skip
            need(getattr(self, name).seconds > 0, name, "a duration > 0")
        need(
            self.step_time_baseline_offset.seconds >= self.window.seconds,
            "step_time_baseline_offset",
            f"a duration >= window ({self.window}) so baseline and current windows do not overlap",
        )
        need(
            self.offload_bandwidth_baseline_window.seconds > self.window.seconds,
            "offload_bandwidth_baseline_window",
            f"a duration > window ({self.window})",
        )

    @classmethod
    def load(cls, path: Path | None = None, overrides: list[str] | None = None) -> AlertSettings:
        """Defaults, then the settings file (a YAML or JSON mapping of field to value), then
        `key=value` overrides (typed by the field).

        Args:
            path: a YAML/JSON file of settings, or None for none.
            overrides: `key=value` strings, applied in order after the file.

        Returns:
            The validated settings.

        Raises:
            SettingsError: an unreadable file, an unknown key (with a did-you-mean), or a
                bad value (naming the field).
        """
        values: dict[str, Any] = {}
        if path is not None:
            values.update(_read_file(Path(path)))
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise SettingsError(f"override {item!r}: expected key=value")
            _check_key(key, source="override")
            values[key] = raw.strip()
        return cls(**values)

    def as_dict(self) -> dict[str, str | float]:
        """Every field and its value (durations as plain strings), e.g. for a settings file."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), str) else v)
                for f in dataclasses.fields(self)}  # fmt: skip


_FIELD_TYPES: dict[str, type] = {
    name: hint if hint in (Duration, str) else float
    for name, hint in get_type_hints(AlertSettings).items()
}


def field_docs() -> dict[str, str]:
    """Each field's docstring (the text under it in the class body), for the docs page."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(AlertSettings))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _check_key(key: str, *, source: str) -> None:
    if key in _FIELD_TYPES:
        return
    close = difflib.get_close_matches(key, list(_FIELD_TYPES), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise SettingsError(f"{source}: unknown alert setting {key!r}{hint}")


def _coerce(name: str, typ: type, value: Any) -> Any:
    """`value` (from a file, an override string or Python) as the field's type."""
    if typ is str:
        if not isinstance(value, str):
            raise SettingsError(f"{name}: expected a string, got {value!r}")
        return value.strip().rstrip("/")
    try:
        if typ is Duration:
            return value if isinstance(value, Duration) else Duration(value)
        if isinstance(value, bool):
            raise ValueError
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError) as e:
        if typ is Duration:
            raise SettingsError(f"{name}: {e}") from None
        raise SettingsError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise SettingsError(f"{name}: expected a finite number, got {value!r}")
    return number


def _read_file(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise SettingsError(f"{path}: cannot read alert settings: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)  # YAML is a superset of JSON: one parser for both
    except yaml.YAMLError as e:
        raise SettingsError(f"{path}: not valid YAML or JSON: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping of setting names to values")
    for key in data:
        _check_key(str(key), source=str(path))
    return {str(k): v for k, v in data.items()}


__all__ = ["AlertSettings", "Duration", "SettingsError", "field_docs"]
