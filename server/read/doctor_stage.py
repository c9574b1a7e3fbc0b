"""The doctor's stage choice: another stage, offload or bucket size priced by the calibrated
planner (zerowatch.predict) against the run's step time, and what to paste."""

from __future__ import annotations

from zerowatch.server.read.doctor_evidence import Evidence
from zerowatch.server.read.doctor_finding import (
    Finding,
    pct,
)
from zerowatch.server.read.doctor_measured import measured
from zerowatch.server.read.doctor_settings import DoctorSettings

from zerowatch import predict
from zerowatch.plan import fmt_bytes, fmt_seconds


def _offloads(p: predict.Prediction) -> bool:
    return p.change.offload_optimizer or p.change.offload_param


def stage_choice(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Another stage, offload or bucket size that fits and is predicted faster; or, when
    memory is short, the layout that frees memory at a stated cost; or, when neither, the
    leanest layout without offload, its cost on record (the calibrated planner,
    zerowatch.predict: every other layout, and a quarter and four times the run's
    reduce_bucket_size where the engine counted its calls at each size, its buffers in the
    peak). Offload is named only where memory is short or it is predicted faster, and never
    on a CPU run as a way to free memory (its device memory is the host's); the config is to
    be pasted only where the change is predicted faster or frees memory the run needs.
    Predictions are against the step with the host to itself (predict.uncontended): a run
    that shared its cores with another process is not told that a change would win back
    what that process took."""
    m = measured(e)
    if m is None or m.world_size < 2:
        return []
    preds = [predict.predict(m, c)
             for c in predict.candidates(m) + predict.bucket_candidates(m)]  # fmt: skip
    short = bool(m.peak_bytes and m.capacity_bytes
                 and m.peak_bytes >= s.memory_headroom_share * m.capacity_bytes)  # fmt: skip
    fitting = [p for p in preds if p.fits is not False]
    now = predict.uncontended(m).step_time_s
    # Which figure "now" is: the run's step time as every surface states it, less what
    # other processes took of the host where they did (the figure the predictions are
    # against), then named apart.
    fig = e.step_time
    now_text = (f"now {fmt_seconds(now)} a step with the host to itself, against the "
                f"{fig.cite()} as measured" if now < m.step_time_s * 0.995
                else f"now {fig.text} a step: the {fig.stat}")  # fmt: skip
    fast = [p for p in fitting if p.step_time_s < (1 - s.stage_choice_min_gain) * now]
    candidates = {"candidates": [p.to_dict(m) for p in sorted(preds, key=lambda p: p.step_time_s)]}
    # Offload frees device memory for host memory: nothing on a CPU run, and not asked for
    # where memory is not short.
    lean = [p for p in fitting if p.model_state_bytes < m.model_state_bytes
            and not (_offloads(p) and (m.device == "cpu" or not short))]  # fmt: skip
    paste = "Paste the prediction's config into the DeepSpeed JSON and compare the next run " \
            "with this one."  # fmt: skip
    if fast and not short:
        best = min(fast, key=lambda p: p.step_time_s)
        what = (f"is predicted {pct(1 - best.step_time_s / now)} faster: "
                f"{fmt_seconds(best.step_time_s)} a step ({now_text}), "
                f"{fmt_bytes(best.model_state_bytes)} of model state per rank (now "
                f"{fmt_bytes(m.model_state_bytes)})")  # fmt: skip
    elif not lean and not short:
        # Nothing faster, nothing that frees memory without offload: the predictions stay on
        # record, and the advice is to keep the layout.
        why = ("offload frees no memory on a CPU run (its device memory is the host's)"
               if m.device == "cpu" else "memory is not short")  # fmt: skip
        return [
            Finding(
                kind="stage_choice",
                severity="info",
                steps=e.window,
                message=f"No layout or bucket size is predicted {pct(s.stage_choice_min_gain)} "
                f"faster ({now_text}), and none frees model state without "
                f"offload; {why}.",
                suggestion="Keep this layout; evidence.candidates holds every other one's "
                "prediction.",
                evidence=candidates,
                chart="memory",
            )
        ]
    else:
        if not lean:
            return []
        # Short of memory: the fastest that frees any; otherwise (none is enough faster)
        # the leanest without offload, so that the trade of memory for time is on record
        # with its cost.
        best = (min(lean, key=lambda p: (p.step_time_s, p.model_state_bytes)) if short
                else min(lean, key=lambda p: (p.model_state_bytes, p.step_time_s)))  # fmt: skip
        what = (f"frees {fmt_bytes(m.model_state_bytes - best.model_state_bytes)} per rank, "
                f"predicted at {fmt_seconds(best.step_time_s)} a step ({now_text})")  # fmt: skip
    fits = {True: "fits", None: "device capacity unknown"}.get(best.fits, "does not fit")
    c = predict.contention(m)
    shared = (f" This run's steps took {c:.2f}x the CPU time its threads used outside the "
              f"collective waits ({fmt_seconds(m.step_time_s)} a step measured): its threads "
              "were off the CPU for other reasons (another process on its cores, or the job "
              "sleeping or waiting on I/O inside its steps); the times here are for the "
              "host to itself." if c > 1 + s.stage_choice_min_gain else "")  # fmt: skip
    lead = best.change.describe()
    suggestion = paste
    if not short and not fast:
        lead = (f"No layout or bucket size is predicted {pct(s.stage_choice_min_gain)} "
                f"faster; the leanest layout without offload, {lead},")  # fmt: skip
        room = "memory is not short" if m.capacity_bytes else "the device's capacity is unknown"
        suggestion = (f"Keep this layout (nothing is predicted faster, and {room}); should "
                      "memory run short, the prediction is what that layout would cost.")  # fmt: skip
    gain = 1 - best.step_time_s / now if now > 0 else 0.0
    return [
        Finding(
            kind="stage_choice",
            severity="warning" if gain >= s.stage_choice_warning_gain else "info",
            steps=e.window,
            message=f"{lead} {what}; {fits}.{shared}",
            suggestion=suggestion,
            evidence=candidates,
            prediction=best.to_dict(m),
            chart="memory",
        )
    ]


__all__ = ["stage_choice"]
