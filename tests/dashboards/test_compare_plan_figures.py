"""The compare and planner pages' figure builders, as pure functions."""

from __future__ import annotations

import dataclasses

import pytest
from zerowatch.dashboards import compare, plan
from zerowatch.dashboards.data import RunSummary

from zerowatch import theory

GIB = 2**30


def summaries() -> list[RunSummary]:
    out = []
    for stage in (1, 2, 3):
        ms = theory.model_state_bytes(10_000_000, 2, stage, precision="fp32").flat()
        comm = theory.comm_bytes_per_step(10_000_000, 2, stage, precision="fp32")
        out.append(
            RunSummary(
                run_id=f"r{stage}",
                name="<script>alert(1)</script>",
                zero_stage=stage,
                world_size=2,
                model_state=ms,
                model_state_theory=ms,
                comm_bytes=comm,
                comm_bytes_theory=comm,
                phases={"forward": 0.1, "backward": 0.2},
                step_time_s=0.35,
                samples_per_s=40.0 + stage,
            )
        )
    return out


def test_model_state_stacks_kinds_per_run_and_shows_memory_going_down_by_stage():
    fig = compare.model_state(summaries())
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["parameters", "gradients", "optimizer states"]
    totals = [sum(t.y[i] for t in bars) for i in range(3)]
    assert totals[0] > totals[1] > totals[2]
    theory_marks = next(t for t in fig.data if t.type == "scatter")
    assert list(theory_marks.y) == pytest.approx(totals)
    assert fig.layout.barmode == "stack"
    # 10M parameters: 152 MiB per rank at stage 1, so the axis reads in MiB, not 0.15 GiB.
    assert fig.layout.yaxis.title.text == "bytes per rank (MiB)"
    assert totals[0] == pytest.approx(sum(summaries()[0].model_state.values()) / 2**20)


def test_byte_axes_pick_the_unit_that_reads_best():
    big = [dataclasses.replace(s, model_state={k: v * 1000 for k, v in s.model_state.items()},
                               model_state_theory={}) for s in summaries()]  # fmt: skip
    assert compare.model_state(big).layout.yaxis.title.text == "bytes per rank (GiB)"
    tiny = [dataclasses.replace(s, model_state={"params": 5000.0}, model_state_theory={})
            for s in summaries()]  # fmt: skip
    assert compare.model_state(tiny).layout.yaxis.title.text == "bytes per rank (KiB)"


def test_comm_bytes_shows_communication_going_up_at_stage_3():
    fig = compare.comm_bytes(summaries())
    bars = [t for t in fig.data if t.type == "bar"]
    totals = [sum((t.y[i] or 0) for t in bars) for i in range(3)]
    assert totals[0] == pytest.approx(totals[1]) and totals[2] > totals[1]
    assert fig.layout.yaxis.title.text == "bytes per step (MiB)"


def test_run_labels_are_escaped_and_distinct_for_equal_names():
    fig = compare.throughput(summaries())
    xs = list(fig.data[0].x)
    assert len(set(xs)) == 3
    assert all("&lt;script&gt;" in x and "<script>" not in x for x in xs)
    assert list(fig.data[0].y) == [41.0, 42.0, 43.0]
    assert fig.layout.yaxis.title.text == "samples/s"


def test_step_phases_stacks_mean_phase_times_in_ms():
    fig = compare.step_phases(summaries())
    fwd = next(t for t in fig.data if t.name == "forward")
    assert list(fwd.y) == pytest.approx([100.0] * 3)
    assert fig.layout.yaxis.title.text == "time per step (ms)"


def test_tradeoff_has_one_point_per_run():
    fig = compare.tradeoff(summaries())
    assert len(fig.data) == 3 and all(len(t.x) == 1 for t in fig.data)
    assert fig.layout.xaxis.title.text == "model-state bytes per rank (MiB)"


def test_stage_plans_follow_the_zero_paper_for_7b_on_64_gpus():
    # 7.5B parameters, N = 64, mixed precision: 120 GB at stage 0, 31.4 GB at stage 1,
    # 16.6 GB at stage 2, 1.875 GB (printed 1.9) at stage 3 (ZeRO paper, Figure 1).
    rows = plan.stage_plans(7_500_000_000, 64, 80e9)
    assert [r.device_total / 1e9 for r in rows] == pytest.approx([120, 31.4, 16.6, 1.875], rel=0.01)
    assert [r.fits for r in rows] == [False, True, True, True]
    assert [r.label for r in rows] == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


def test_plan_memory_draws_the_gpu_memory_line_and_kinds_per_option():
    rows = [
        *plan.stage_plans(7_000_000_000, 8, 80 * GIB),
        plan.StagePlan(stage=3, offload="optimizer+params", device={"grads": 2 * GIB},
                       buffers={"live_params": GIB}, host_bytes=100 * GIB),
    ]  # fmt: skip
    fig = plan.memory(rows, 80 * GIB)
    assert fig.layout.shapes[0].y0 == pytest.approx(80.0)
    kinds = [t.name for t in fig.data if t.offsetgroup == "device"]
    assert kinds == ["parameters", "gradients", "optimizer states", "fp32 master weights",
                     "ZeRO buffers"]  # fmt: skip
    host = next(t for t in fig.data if t.name == "on the host (offloaded)")
    assert list(host.y) == pytest.approx([0, 0, 0, 0, 100.0])
    assert fig.data[0].x[0] == "ZeRO-0"
    assert fig.data[0].x[-1] == "ZeRO-3 + offload optimizer+params"
    assert fig.layout.yaxis.title.text == "bytes per rank (GiB)"


def test_plan_communication_converts_bytes_to_seconds_at_the_given_bandwidth():
    rows = plan.stage_plans(1_000_000_000, 8, 80 * GIB)
    fig = plan.communication(rows, bandwidth_bytes_per_s=100e9)
    secs = next(t for t in fig.data if t.type == "scatter")
    assert list(secs.y) == pytest.approx([r.traffic_bytes / 100e9 for r in rows])
    sent = next(t for t in fig.data if t.type == "bar")
    assert list(sent.y) == pytest.approx([r.traffic_bytes / GIB for r in rows])
    # The paper's 2Ψ for stages 0-2 and 3Ψ for stage 3.
    assert sent.y[0] == pytest.approx(sent.y[1]) == pytest.approx(sent.y[2])
    assert sent.y[3] == pytest.approx(1.5 * sent.y[0])
    assert fig.layout.yaxis.title.text == "bytes sent per step (GiB)"
    assert fig.layout.yaxis2.title.text == "seconds per step"


def test_plan_memory_cuts_the_axis_at_three_gpus_and_labels_the_cut_bars():
    rows = plan.stage_plans(70_000_000_000, 64, 80 * GIB)
    fig = plan.memory(rows, 80 * GIB)
    assert fig.layout.yaxis.range == (0, 240.0)
    notes = {a.x: a.text for a in fig.layout.annotations if a.text.startswith("↑")}
    # 70B: 1.12 TB under DDP, 293 GB at stage 1 run past 240 GiB; stage 2 (147 GiB) does not.
    assert set(notes) == {"ZeRO-0", "ZeRO-1"}
    assert "TiB" in notes["ZeRO-0"]


def stored_run(**over: object) -> dict[str, object]:
    """A run's stored fields as the compare page gets them (/api/v1/runs' shape)."""
    run: dict[str, object] = {
        "run_id": "r", "name": "n", "status": "finished", "zero_stage": 2,
        "offload_optimizer": "none", "offload_param": "none", "precision": "bf16",
        "world_size": 2, "param_count": 1_230_000, "engine": "zerowatch",
        "config": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 2, "reduce_bucket_size": 500_000_000}},
    }  # fmt: skip
    run.update(over)
    return run


def test_compare_says_what_differs_between_its_runs_not_always_the_stage():
    """The page said "Same model, different ZeRO stages…" over any runs compared."""
    line = compare.differences([stored_run(precision="fp32"), stored_run(precision="bf16"),
                                stored_run(precision="fp16")])  # fmt: skip
    assert line.startswith("What differs: precision (fp32, bf16, fp16).")
    assert "ZeRO stage 2" in line and "model 1.23M parameters" in line
    assert "world size 2 ranks" in line and "sharded" not in line
    # Stage and offload differ: both named, and the ZeRO trade said.
    line = compare.differences([stored_run(zero_stage=1),
                                stored_run(zero_stage=3, offload_optimizer="cpu")])  # fmt: skip
    assert line.startswith("What differs: ZeRO stage (1, 3); offload (none, optimizer to the CPU).")
    assert "communication per step goes up" in line
    # Another model, and buckets of another size.
    bucket = {"zero_optimization": {"reduce_bucket_size": 5e7}}
    line = compare.differences([stored_run(), stored_run(param_count=7_000_000_000,
                                                         config=bucket)])  # fmt: skip
    assert "model (1.23M parameters, 7B parameters)" in line
    assert "reduce bucket (500M elements, 50M elements)" in line
    assert "micro-batch (8, unknown)" in line
    # Nothing differs: said, with what they share.
    line = compare.differences([stored_run(), stored_run()])
    assert line.startswith("Same setup: model 1.23M parameters, ZeRO stage 2")
    assert compare.differences([stored_run()]) == ""


def test_compare_page_renders_the_differences_line_escaped():
    from zerowatch.dashboards import html

    runs = [stored_run(precision="<b>x</b>"), stored_run()]
    page = html.render("compare.html", runs=[{**r, "offload": "none", "model_state_bytes": None,
                                              "model_state_theory_bytes": None, "comm_bytes": None,
                                              "step_time_s": None, "samples_per_s": None}
                                             for r in runs],
                       missing=[], charts=[], figures={}, nav="compare",
                       recent="median over the newest 20 steps")  # fmt: skip
    assert "Same model, different ZeRO stages" not in page
    assert 'id="compare-differs">What differs: precision (&lt;b&gt;x&lt;/b&gt;, bf16).' in page
