"""The doctor on training signals: fp16's loss scale and skipped steps, gradient-norm
spikes, and non-finite steps (with where they began: doctor_crash.origin)."""

from __future__ import annotations

import statistics

from zerowatch.server.read.doctor_evidence import Evidence
from zerowatch.server.read.doctor_finding import (
    Finding,
    ordered,
    pct,
    typical,
)
from zerowatch.server.read.doctor_settings import DoctorSettings


def loss_scale(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """fp16's dynamic loss scale collapsing, and skipped steps."""
    scale = ordered(e.signals.get("loss_scale"))
    skipped = ordered(e.signals.get("skipped"), "max")
    in_window = [v for st, v in skipped if st >= e.window[0]]
    skip_share = sum(1 for v in in_window if v > 0) / len(in_window) if in_window else 0.0
    if not scale and not skip_share:
        return []
    latest = scale[-1][1] if scale else None
    top = max(v for _, v in scale) if scale else None
    problems, severity = [], None
    if latest is not None and latest <= s.loss_scale_floor:
        problems.append(f"the loss scale has collapsed to {latest:g}")
        severity = "critical"
    elif latest and top and top / latest > s.loss_scale_drop_factor:
        problems.append(f"the loss scale fell {top / latest:,.0f}-fold (from {top:g} to "
                        f"{latest:g})")  # fmt: skip
        severity = "warning"
    if skip_share > s.skipped_share:
        problems.append(f"{pct(skip_share)} of the recent steps were skipped (gradient "
                        "overflow: no update)")  # fmt: skip
        severity = "critical" if skip_share >= 0.5 or severity == "critical" else "warning"
    if severity is None:
        return []
    steps = [st for st, v in skipped if v > 0]
    return [
        Finding(
            kind="loss_scale",
            severity=severity,
            steps=(steps[0], steps[-1]) if steps else e.signal_window,
            message="fp16: " + "; ".join(problems) + ".",
            suggestion='Train in bf16 where the hardware has it ("bf16": {"enabled": '
            "true}); otherwise find what overflows (attention logits, a loss without "
            "reduction, a learning rate too high for the warm-up) and clip gradients.",
            evidence={
                "loss_scale": latest,
                "max_loss_scale": top,
                "skipped_share": skip_share,
                "skipped_steps_total": e.totals.get("skipped_steps", (0.0, []))[0],
            },
            chart="training",
        )
    ]


def grad_norm_spike(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Steps whose gradient norm is far above the median of the steps before them."""
    norms = ordered(e.signals.get("grad_norm"), "max")
    n0 = int(s.grad_norm_baseline_steps)
    spikes = []
    for i in range(n0, len(norms)):
        base = statistics.median(v for _, v in norms[max(0, i - 10 * n0) : i])
        if base > 0 and norms[i][1] > s.grad_norm_spike_ratio * base:
            spikes.append((norms[i][0], norms[i][1] / base))
    if not spikes:
        return []
    worst = max(spikes, key=lambda x: x[1])
    return [
        Finding(
            kind="grad_norm_spike",
            severity="warning",
            steps=(spikes[0][0], spikes[-1][0]),
            message=f"{len(spikes)} step(s) with a gradient norm over "
            f"{s.grad_norm_spike_ratio:g}x the median before them; the worst, step {worst[0]}, "
            f"{worst[1]:.0f}x.",
            suggestion="Check the batches of those steps (bad or duplicated samples); clip "
            "gradients (gradient_clipping: 1.0), lower the learning rate or lengthen warm-up.",
            evidence={"spikes": [{"step": st, "ratio": r} for st, r in spikes[-10:]]},
            chart="training",
        )
    ]


def nonfinite(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Steps with a NaN/inf loss or gradient that were not skipped by the fp16 loss scaler
    (a skipped overflow step is the loss_scale finding's)."""
    bad = ordered(e.signals.get("nonfinite"), "max")
    skipped = dict(ordered(e.signals.get("skipped"), "max"))
    steps = [st for st, v in bad if v > 0 and not skipped.get(st)]
    origin = e.origin
    how = "that was not skipped: the weights may hold NaN from there on"
    if not steps and origin.get("forward_module"):
        # Skipped by the loss scaler, but born in a module's forward: still worth naming.
        steps = [st for st, v in bad if v > 0]
        how = "(the loss scaler skipped them; the forward will make NaN again)"
    if not steps:
        return []
    rank = origin.get("first_rank", typical(e.signals.get("nonfinite"), "max_rank"))
    began = ""
    if origin.get("forward_module"):
        began = (f" It began on rank {origin['forward_rank']} in {origin['forward_module']}: "
                 "the first module whose forward output was not finite (traced at step "
                 f"{origin['forward_step']}).")  # fmt: skip
    elif origin.get("first_module"):
        began = (f" It began on rank {origin['first_rank']} in {origin['first_module']}"
                 f" (step {origin['first_step']}: its local gradients, before the "
                 "reduction).")  # fmt: skip
    return [
        Finding(
            kind="nonfinite",
            severity="critical",
            ranks=(rank,) if rank is not None else (),
            steps=(steps[0], steps[-1]),
            message=f"{len(steps)} step(s) had a non-finite loss or gradient {how}.{began}",
            suggestion="Roll back to the checkpoint before the first such step; look for a "
            "bad batch, a division by zero or log(0) in the loss, a learning rate spike; "
            "enable gradient clipping.",
            evidence={
                "steps": steps[-20:],
                "nonfinite_steps_total": e.totals.get("nonfinite_steps", (0.0, []))[0],
                "first_rank": origin.get("first_rank"),
                "first_module": origin.get("first_module"),
                **{k: v for k, v in origin.items() if k not in ("first_rank", "first_module")},
            },
            chart="training",
        )
    ]


__all__ = ["grad_norm_spike", "loss_scale", "nonfinite"]
