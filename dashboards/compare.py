"""Figures of the compare page (`/compare?runs=a,b,c`): runs side by side.

The same model at ZeRO stages 1, 2 and 3 shows the trade the paper describes: model-state
bytes per rank go down (optimizer states, then gradients, then parameters are sharded)
while the bytes communicated per step go up (stage 3 gathers the parameters twice). Each
builder takes a list of dashboards.data.RunSummary and returns a go.Figure with one bar (or
one point) per run, in the given order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from zerowatch.dashboards import theme as th
from zerowatch.dashboards.data import RunSummary

from zerowatch.events import COLLECTIVE_OPS, STATE_KINDS, STEP_PARTS
from zerowatch.units import fmt_count

#: Legend to the right of the plot: compare charts have long category labels below.
_LEGEND_RIGHT = {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top",
                 "font": {"size": 11}}  # fmt: skip
_MARGIN = {"l": 64, "r": 170, "t": 56, "b": 64}
_NAME_CHARS = 32


def _labels(runs: Sequence[RunSummary]) -> list[str]:
    """Category labels: the run's name (shortened) over its stage; two runs of one name get
    their id's head too, so that their bars do not merge."""
    short = [
        r.name if len(r.name) <= _NAME_CHARS else r.name[: _NAME_CHARS - 1] + "…" for r in runs
    ]
    out = []
    for name, r in zip(short, runs, strict=True):
        label = th.text(name)
        if short.count(name) > 1 and sum(1 for o in runs if o.label == r.label) > 1:
            label += f" · {th.text(r.run_id[:6])}"
        out.append(f"{label}<br>stage {r.zero_stage}")
    return out


def _figure(title: str) -> go.Figure:
    return th.figure(title, height=400, legend=_LEGEND_RIGHT, margin=_MARGIN)


#: The phases that partition a step (with the gap outside them): stacked when a run has
#: no exclusive parts.
_TOP = ("forward", "backward", "optimizer_step")


def _kinds(dicts: Sequence[dict[str, float]], known: Sequence[str]) -> list[str]:
    # Kinds that are zero everywhere (no master weights in fp32) would only clutter the legend.
    seen = {k for d in dicts for k, v in d.items() if v}
    return [k for k in known if k in seen] + sorted(seen - set(known))


def _byte_unit(totals: Sequence[float]) -> tuple[str, float]:
    """The binary unit that reads best for the largest total: GiB, MiB or KiB."""
    top = max((t for t in totals if t), default=0.0)
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20)):
        if top >= size:
            return unit, size
    return "KiB", 2.0**10


def _offload(run: Mapping[str, Any]) -> str:
    parts = [name for name, key in (("optimizer", "offload_optimizer"), ("params", "offload_param"))
             if run.get(key) not in (None, "", "none")]  # fmt: skip
    return " + ".join(parts) + " to the CPU" if parts else "none"


def _config(*path: str) -> Callable[[Mapping[str, Any]], object]:
    def get(run: Mapping[str, Any]) -> object:
        value: object = run.get("config") or {}
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    return get


#: What a compare page weighs runs by: (name, how a run's stored fields give it, how it
#: prints). Runs that agree on all of these differ in timing alone.
ASPECTS: tuple[tuple[str, Callable[[Mapping[str, Any]], object], Callable[[Any], str]], ...] = (
    ("model", lambda r: r.get("param_count") or None, lambda n: f"{fmt_count(n)} parameters"),
    ("ZeRO stage", lambda r: r.get("zero_stage"), str),
    ("offload", _offload, str),
    ("precision", lambda r: r.get("precision"), str),
    ("world size", lambda r: r.get("world_size"), lambda n: f"{n} ranks"),
    ("micro-batch", _config("train_micro_batch_size_per_gpu"), str),
    ("gradient accumulation", _config("gradient_accumulation_steps"), lambda n: f"{n} step{'' if n == 1 else 's'}"),
    ("reduce bucket", _config("zero_optimization", "reduce_bucket_size"),
     lambda n: f"{fmt_count(n)} elements" if isinstance(n, (int, float)) else str(n)),
    ("engine", lambda r: r.get("engine"), str),
)  # fmt: skip


def differences(runs: Sequence[Mapping[str, Any]]) -> str:
    """The compare page's line on what differs between its runs (stored run fields, as
    /api/v1/runs gives them) and what they share; an empty string for fewer than two runs.

    The ZeRO trade (memory down, communication up as more state is sharded) is said only
    where the stage is among the differences: runs of one stage differ by something else.
    """
    if len(runs) < 2:
        return ""
    differ, same = [], []
    for name, get, show in ASPECTS:
        values = [get(r) for r in runs]
        if all(v is None for v in values):
            continue
        shown = ["unknown" if v is None else show(v) for v in values]
        if len(set(shown)) > 1:
            differ.append(f"{name} ({', '.join(dict.fromkeys(shown))})")
        else:
            same.append(f"{name} {shown[0]}")
    shared = f"Same: {', '.join(same)}." if same else ""
    if not differ:
        return f"Same setup: {', '.join(same)}. What differs is run to run (the host, the time)."
    line = f"What differs: {'; '.join(differ)}. {shared}".strip()
    if any(d.startswith("ZeRO stage") for d in differ):
        line += (" Memory per rank goes down as more state is sharded, communication per "
                 "step goes up.")  # fmt: skip
    return line


def model_state(runs: Sequence[RunSummary]) -> go.Figure:
    """Per-rank model-state bytes of each run, stacked by kind (host-offloaded kinds hatched),
    with the ZeRO theory's total as a diamond."""
    fig = _figure("Model-state bytes per rank")
    x = _labels(runs)
    unit, size = _byte_unit([sum(r.model_state.values()) for r in runs]
                            + [sum(r.model_state_theory.values()) for r in runs])  # fmt: skip
    device_kinds = [k for k in STATE_KINDS] + [f"host_{k}" for k in STATE_KINDS]
    for kind in _kinds([r.model_state for r in runs], device_kinds):
        base = kind.removeprefix("host_")
        host = kind.startswith("host_")
        fig.add_trace(
            go.Bar(
                x=x,
                y=th.scaled([r.model_state.get(kind) for r in runs], size),
                name=th.kind_label(base) + (" (host)" if host else ""),
                marker={
                    "color": th.KIND_COLORS.get(base),
                    "pattern": {"shape": "x" if host else ""},
                },
                hovertemplate=f"%{{y:.4~f}} {unit}",
            )
        )
    _theory_diamonds(fig, x, [sum(r.model_state_theory.values()) for r in runs],
                     name="ZeRO theory (total)", unit=unit, size=size)  # fmt: skip
    fig.update_layout(barmode="stack", yaxis={"title": {"text": f"bytes per rank ({unit})"}})
    return fig


def _theory_diamonds(fig: go.Figure, x: list[str], totals: list[int], *, name: str,
                     unit: str, size: float) -> None:  # fmt: skip
    """The theoretical total of each run as a diamond over its bar (none when unknown)."""
    theory = [t or None for t in totals]
    if any(theory):
        fig.add_trace(
            th.scatter(
                x=x,
                y=th.scaled(theory, size),
                name=name,
                mode="markers",
                marker={"symbol": "diamond", "size": 12, "color": th.THEORY_COLOR},
                hovertemplate=f"theory %{{y:.4~f}} {unit}",
            )
        )


def comm_bytes(runs: Sequence[RunSummary]) -> go.Figure:
    """Collective bytes (nccl-tests size) per step per rank, stacked by op, theory as a diamond."""
    fig = _figure("Bytes communicated per step")
    x = _labels(runs)
    unit, size = _byte_unit([sum(v for v in r.comm_bytes.values() if v) for r in runs]
                            + [sum(r.comm_bytes_theory.values()) for r in runs])  # fmt: skip
    for op in _kinds([r.comm_bytes for r in runs], COLLECTIVE_OPS):
        fig.add_trace(
            go.Bar(
                x=x,
                y=th.scaled([r.comm_bytes.get(op) for r in runs], size),
                name=th.op_label(op),
                marker={"color": th.OP_COLORS.get(op)},
                hovertemplate=f"%{{y:.4~f}} {unit} per step",
            )
        )
    _theory_diamonds(fig, x, [sum(r.comm_bytes_theory.values()) for r in runs],
                     name="ZeRO theory", unit=f"{unit} per step", size=size)  # fmt: skip
    fig.update_layout(barmode="stack", yaxis={"title": {"text": f"bytes per step ({unit})"}})
    return fig


def step_phases(runs: Sequence[RunSummary]) -> go.Figure:
    """Mean time per step in each exclusive part (events.STEP_PARTS), stacked, with the mean
    step time as a marker: the parts add up to it, so the stack meets the marker. Runs
    whose agent reports no parts stack their top-level phases (forward, backward, optimizer
    step) and `other`, which partition the step too; nested phases are never stacked."""
    with_parts = any(r.parts for r in runs)
    fig = _figure("Step time by part (mean)" if with_parts else "Step time by phase (mean)")
    x = _labels(runs)
    if with_parts:
        kinds = _kinds([r.parts for r in runs], STEP_PARTS)
        values, colors, labels = (
            lambda k: [r.parts.get(k) for r in runs], th.PART_COLORS, th.PART_LABELS
        )  # fmt: skip
    else:
        kinds = _kinds([{k: v for k, v in r.phases.items() if k in _TOP} for r in runs], _TOP)
        values, colors, labels = (
            lambda k: [r.phases.get(k) for r in runs], th.PHASE_COLORS, th.PHASE_LABELS
        )  # fmt: skip
    for kind in kinds:
        fig.add_trace(
            go.Bar(
                x=x,
                y=th.scaled(values(kind), 1e-3),
                name=labels.get(kind, th.text(kind)),
                marker={"color": colors.get(kind)},
                hovertemplate="%{y:.3~f} ms",
            )
        )
    step = [(r.step_time_mean_s if with_parts and r.step_time_mean_s is not None
             else r.step_time_s) for r in runs]  # fmt: skip
    fig.add_trace(
        th.scatter(
            x=x,
            y=th.scaled(step, 1e-3),
            name="step time",
            mode="markers",
            marker={
                "symbol": "line-ew-open",
                "size": 28,
                "color": "#2d3436",
                "line": {"width": 3, "color": "#2d3436"},
            },
            hovertemplate="step %{y:.3~f} ms",
        )
    )
    fig.update_layout(barmode="stack", yaxis={"title": {"text": "time per step (ms)"}})
    return fig


def throughput(runs: Sequence[RunSummary]) -> go.Figure:
    """Mean samples per second of each run (all ranks together)."""
    fig = th.figure("Throughput", height=380)
    x = _labels(runs)
    fig.add_trace(
        go.Bar(
            x=x,
            y=[r.samples_per_s for r in runs],
            name="samples/s",
            marker={"color": [th.color_for(i) for i in range(len(runs))]},
            text=[th.fmt_rate(r.samples_per_s, "samples/s") for r in runs],
            textposition="auto",
            hovertemplate="%{y:.4~g} samples/s<extra></extra>",
        )
    )
    fig.update_layout(showlegend=False, yaxis={"title": {"text": "samples/s"}})
    return fig


def tradeoff(runs: Sequence[RunSummary]) -> go.Figure:
    """Memory against communication, one point per run: the ZeRO trade in one picture."""
    fig = th.figure("Memory vs communication", height=380)
    xu, xs = _byte_unit([sum(r.model_state.values()) for r in runs])
    yu, ys = _byte_unit([sum(v for v in r.comm_bytes.values() if v) for r in runs])
    for i, (label, r) in enumerate(zip(_labels(runs), runs, strict=True)):
        fig.add_trace(
            th.scatter(
                x=[sum(r.model_state.values()) / xs],
                y=[sum(v for v in r.comm_bytes.values() if v) / ys],
                name=label,
                mode="markers+text",
                text=[f"stage {r.zero_stage}"],
                textposition="top center",
                marker={"size": 16, "color": th.color_for(i)},
                hovertemplate=f"%{{x:.4~f}} {xu} per rank<br>%{{y:.4~f}} {yu} per step",
            )
        )
    fig.update_layout(
        xaxis={"title": {"text": f"model-state bytes per rank ({xu})"}, "rangemode": "tozero"},
        yaxis={"title": {"text": f"bytes communicated per step ({yu})"}, "rangemode": "tozero"},
    )
    return fig


#: Charts of the compare page in page order: (id, full width?).
CHARTS = (
    ("model_state", False),
    ("comm", False),
    ("phases", False),
    ("throughput", False),
    ("tradeoff", True),
)


def figures(runs: Sequence[RunSummary]) -> dict[str, go.Figure]:
    """The compare page's charts by chart id, in page order."""
    return {
        "model_state": model_state(runs),
        "comm": comm_bytes(runs),
        "phases": step_phases(runs),
        "throughput": throughput(runs),
        "tradeoff": tradeoff(runs),
    }


__all__ = [
    "ASPECTS",
    "CHARTS",
    "comm_bytes",
    "differences",
    "figures",
    "model_state",
    "step_phases",
    "throughput",
    "tradeoff",
]
