"""The run page's figure builders, as pure functions: given data, the expected traces, axes
and units."""

from __future__ import annotations

import pytest
from zerowatch.dashboards import run
from zerowatch.dashboards.data import (
    Quantiles,
    RankDistribution,
    RankGrid,
    Series,
    SizePoints,
    Straggler,
)

STEPS = [0, 1, 2, 3]


def s(values: list[float | None]) -> Series:
    return Series(STEPS[: len(values)], values)


def names(fig) -> list[str]:
    return [t.name for t in fig.data]


def test_step_breakdown_stacks_phases_in_ms_and_marks_exposed_comm():
    fig = run.step_breakdown(
        s([0.5, 0.5, 0.6, 0.5]),
        {"backward": s([0.2] * 4), "forward": s([0.1] * 4), "grad_reduce": s([0.05] * 4)},
        exposed_comm=s([0.04] * 4),
    )
    assert names(fig) == [
        "forward",
        "backward",
        "gradient reduce",
        "other (unattributed)",
        "step time",
        "exposed communication",
    ]
    stacked = [t for t in fig.data if t.stackgroup == "phases"]
    assert [t.name for t in stacked][:3] == ["forward", "backward", "gradient reduce"]
    assert list(stacked[0].y) == pytest.approx([100.0] * 4)  # seconds -> ms
    # "other" fills the stack up to the step time: 0.5 - 0.35 = 0.15 s.
    assert list(stacked[3].y) == pytest.approx([150.0, 150.0, 250.0, 150.0])
    exposed = fig.data[-1]
    assert exposed.line.dash == "dot" and list(exposed.y) == pytest.approx([40.0] * 4)
    assert fig.layout.yaxis.title.text == "time per step (ms)"
    assert fig.layout.xaxis.title.text == "step"


def test_step_breakdown_draws_unknown_phases_as_lines_beside_the_stack():
    fig = run.step_breakdown(
        s([0.5, 0.5]), {"forward": s([0.2, 0.2]), "backward_inner": s([0.1, 0.1])}
    )
    inner = next(t for t in fig.data if t.name == "backward_inner")
    assert inner.stackgroup is None and inner.line.dash == "dash"
    other = next(t for t in fig.data if t.name == "other (unattributed)")
    assert list(other.y) == pytest.approx([300.0, 300.0])  # only known phases fill the stack


def test_step_breakdown_has_no_other_band_when_phases_cover_the_step():
    fig = run.step_breakdown(s([0.3, 0.3]), {"forward": s([0.1, 0.1]), "backward": s([0.25, 0.25])})
    assert "other (unattributed)" not in names(fig)


def test_collectives_plot_latency_ms_and_busbw_gbps_per_op():
    fig = run.collectives(
        {"all_gather": s([0.002, 0.004]), "reduce_scatter": s([0.001, 0.001])},
        {"all_gather": s([2e9, 4e9]), "reduce_scatter": s([1e9, 1e9])},
    )
    by = {(t.name, t.yaxis): t for t in fig.data}
    assert list(by[("all-gather", "y")].y) == pytest.approx([2.0, 4.0])
    assert list(by[("all-gather", "y2")].y) == pytest.approx([2.0, 4.0])
    assert fig.layout.yaxis.title.text == "latency (ms)"
    assert fig.layout.yaxis2.title.text == "bus bandwidth (GB/s)"
    assert fig.layout.xaxis2.title.text == "step"


def test_bandwidth_vs_size_uses_a_log_size_axis_and_draws_the_ceiling():
    fig = run.bandwidth_vs_size(
        {"all_reduce": SizePoints(sizes=[1e6, 1e8], busbw=[1e9, 9e9], steps=[0, 1])},
        ceiling_bytes_per_s=10e9,
    )
    (trace,) = fig.data
    assert trace.mode == "markers" and list(trace.x) == [1e6, 1e8]
    assert list(trace.y) == pytest.approx([1.0, 9.0])
    assert fig.layout.xaxis.type == "log"
    assert fig.layout.xaxis.title.text == "message size (bytes per call)"
    assert fig.layout.yaxis.title.text == "bus bandwidth (GB/s)"
    assert fig.layout.shapes[0].y0 == pytest.approx(10.0)
    assert "measured ceiling" in fig.layout.annotations[0].text


def dist(values: list[float], ranks: list[int | None] | None = None, *, n: int = 0,
         positions: list[float] | None = None) -> RankDistribution:  # fmt: skip
    ranks = list(range(len(values))) if ranks is None else ranks
    return RankDistribution(n=n or len(values), step=7, values=values, ranks=ranks,
                            positions=positions or list(range(len(values))))  # fmt: skip


def test_memory_sorts_the_ranks_peaks_against_theory_state_and_capacity():
    gib = 2**30
    fig = run.memory_by_rank(
        dist([4 * gib, 5 * gib], [1, 0]),
        {"params": gib, "host_optimizer_states": 8 * gib},
        {"forward": Quantiles(3 * gib, 3 * gib, 3 * gib, 3 * gib, 3 * gib),
         "backward": Quantiles(4 * gib, 4.1 * gib, 4.5 * gib, 4.9 * gib, 5 * gib)},
        {"params": gib, "grads": gib, "host_optimizer_states": 8 * gib},
        stage=3, capacity_bytes=40 * gib,
    )  # fmt: skip
    assert names(fig) == [
        "peak per rank (sorted)",
        "model states held (median rank)",
        "ZeRO-3 theory: model states",
        "device capacity 40 GiB",
        "peak by phase: median rank (whiskers: lowest, highest rank)",
    ]
    peak = fig.data[0]
    assert list(peak.x) == [0, 1] and list(peak.y) == pytest.approx([4.0, 5.0])
    assert list(peak.text) == ["rank 1", "rank 0"]  # the hover names the rank of each point
    # Host-offloaded state does not count against the device.
    assert list(fig.data[1].y) == pytest.approx([1.0, 1.0])
    assert list(fig.data[2].y) == pytest.approx([2.0, 2.0])
    assert list(fig.data[3].y) == pytest.approx([40.0, 40.0])
    bars = fig.data[4]
    assert list(bars.x) == ["forward", "backward"] and list(bars.y) == pytest.approx([3.0, 4.5])
    assert list(bars.error_y.array) == pytest.approx([0.0, 0.5])
    assert list(bars.error_y.arrayminus) == pytest.approx([0.0, 0.5])
    assert fig.layout.yaxis.title.text == "memory (GiB)"
    assert (
        fig.layout.title.text == "Memory over ranks at step 7<br><sup>2 ranks sorted by peak</sup>"
    )


def test_memory_of_a_wide_run_draws_its_ends_and_quantiles_not_a_bar_per_rank():
    gib = 2**30
    values = [1.0 * gib] * 16 + [1.1 * gib, 1.2 * gib, 1.3 * gib] + [1.4 * gib] * 15 + [3 * gib]
    ranks = [*range(16), None, None, None, *range(16, 31), 4000]
    positions = [*range(16), 409.5, 2047.5, 3685.5, *range(4080, 4096)]
    fig = run.memory_by_rank(dist(values, ranks, n=4096, positions=positions), {}, {}, {},
                             stage=3, capacity_bytes=None)  # fmt: skip
    (peak,) = [t for t in fig.data if t.type == "scatter"]
    assert len(peak.x) == 35 and peak.x[-1] == 4095
    assert list(peak.text[16:19]) == ["p10 over ranks", "median rank", "p90 over ranks"]
    assert peak.text[-1] == "rank 4000"
    assert (
        "4,096 ranks sorted by peak: the 16 lowest and 16 highest, the p10, median and p90 "
        "between" in fig.layout.title.text
    )
    # Nobody reported the device's capacity: the chart says so and draws no made-up line.
    assert "device capacity not reported" in fig.layout.title.text
    assert not any("capacity" in (t.name or "") for t in fig.data)


def test_memory_uses_mib_and_a_log_axis_when_the_peak_dwarfs_the_model_states():
    mib = 2**20
    fig = run.memory_by_rank(dist([350 * mib]), {"params": 2 * mib}, {}, {"params": 2 * mib},
                             stage=2)  # fmt: skip
    assert fig.layout.yaxis.type == "log"
    assert fig.layout.yaxis.title.text == "memory (MiB, log scale)"
    assert list(fig.data[0].y) == pytest.approx([350.0])


def test_memory_names_a_capacity_that_would_flatten_the_peaks_instead_of_drawing_it():
    mib = 2**20
    fig = run.memory_by_rank(dist([300 * mib]), {}, {}, {"params": 100 * mib}, stage=1,
                             capacity_bytes=80 * 2**30)  # fmt: skip
    assert not any("capacity" in (t.name or "") for t in fig.data)
    assert "device capacity 80 GiB, off the scale" in fig.layout.title.text


def test_bands_show_the_spread_over_ranks_of_phases_exposed_comm_and_collectives():
    band = {"min": s([1e-3, 2e-3]), "p10": s([2e-3, 3e-3]), "p50": s([3e-3, 4e-3]),
            "p90": s([4e-3, 5e-3]), "max": s([9e-3, 9e-3])}  # fmt: skip
    fig = run.phase_spread({"phase.forward": band, "phase.backward": band, "phase.odd": band})
    panels = [a.text for a in fig.layout.annotations]
    assert panels == ["forward", "backward", "odd"]
    fwd = [t for t in fig.data if t.legendgroup == "forward"]
    assert [t.fill for t in fwd] == [None, "tonexty", None, "tonexty", None]
    assert list(fwd[1].y) == pytest.approx([9.0, 9.0])  # the min-max band's top, in ms
    assert list(fwd[4].y) == pytest.approx([3.0, 4.0])  # the median line
    # Three panels in two columns: the third starts a second row on the left.
    assert fig.layout.xaxis3.domain[0] == 0.0 and fig.layout.yaxis3.domain[1] < 0.5
    spread = run.rank_spread({"busy_s": band, "step_time_s": band, "exposed_comm_s": band})
    assert [a.text for a in spread.layout.annotations][-1].startswith("exposed communication")
    coll = run.collectives({"all_gather": s([0.003, 0.004])}, {"all_gather": s([2e9, 3e9])},
                           {"collective.all_gather.latency_s": band,
                            "collective.all_gather.busbw": {k: s([v.values[0] * 1e12] * 2)
                                                            for k, v in band.items()}})  # fmt: skip
    fills = [t for t in coll.data if t.fill == "tonexty"]
    assert len(fills) == 4 and {t.yaxis for t in fills} == {"y", "y2"}
    assert all(t.legendgroup == "all_gather" for t in fills)
    assert list(fills[0].y) == pytest.approx([9.0, 9.0])
    assert list(fills[3].y) == pytest.approx([4.0, 4.0])  # p90 of the bus bandwidth, GB/s


def test_offload_plots_each_direction_in_gbps():
    fig = run.offload({"d2h": s([12e9, 12e9]), "h2d": s([10e9, 11e9])})
    assert names(fig) == ["device → host", "host → device"]
    assert list(fig.data[1].y) == pytest.approx([10.0, 11.0])
    assert fig.layout.yaxis.title.text == "bandwidth (GB/s)"


def test_training_marks_clipped_and_skipped_steps():
    fig = run.training(
        grad_norm=s([0.5, 2.0, 0.7, 3.0]),
        loss=s([4, 3, 2, 1]),
        lr=s([1e-4] * 4),
        loss_scale=s([65536, 32768, 32768, 32768]),
        clipped_steps=[1, 3],
        skipped_steps=[1],
    )
    by = {t.name: t for t in fig.data}
    assert list(by["clipped"].x) == [1, 3] and list(by["clipped"].y) == [2.0, 3.0]
    assert list(by["skipped step"].x) == [1] and by["skipped step"].yaxis == "y4"
    assert fig.layout.yaxis4.type == "log"
    assert fig.layout.xaxis4.title.text == "step"


def test_a_constant_learning_rate_is_drawn_around_its_value():
    fig = run.training(grad_norm=s([0.5, 2.0, 0.7]), loss=s([4, 3, 2]), lr=s([1e-3] * 3))
    assert list(fig.layout.yaxis3.range) == pytest.approx([5e-4, 1.5e-3])  # not -0.5..1
    assert fig.layout.yaxis.range is None  # a varying series keeps plotly's autorange
    flat_zero = run.training(grad_norm=s([0.0] * 3), loss=s([1, 2, 3]), lr=s([1e-4, 2e-4, 3e-4]))
    assert list(flat_zero.layout.yaxis.range) == [-1.0, 1.0]


def test_markers_on_every_step_become_a_note():
    fig = run.training(grad_norm=s([5.0, 6.0, 7.0]), loss=s([3, 2, 1]), lr=s([1e-4] * 3),
                       loss_scale=s([1.0, 1.0, 1.0]), clipped_steps=STEPS[:3],
                       skipped_steps=STEPS[:3])  # fmt: skip
    assert "clipped" not in names(fig) and "skipped step" not in names(fig)
    titles = [a.text for a in fig.layout.annotations]
    assert "gradient norm, pre-clip (every step clipped)" in titles
    assert "loss scale (every step skipped)" in titles
    some = run.training(grad_norm=s([5.0, 6.0, 7.0]), loss=s([3, 2, 1]), lr=s([1e-4] * 3),
                        clipped_steps=STEPS[1:2])  # fmt: skip
    assert "clipped" in names(some)
    assert "gradient norm, pre-clip (✕ clipped)" in [a.text for a in some.layout.annotations]


def test_training_has_no_loss_scale_panel_without_loss_scaling():
    fig = run.training(grad_norm=s([1.0]), loss=s([1.0]), lr=s([1e-4]))
    assert {t.yaxis for t in fig.data} == {"y", "y2", "y3"}


def test_rank_heatmap_names_the_straggler_in_its_title():
    grid = RankGrid(
        ranks=[0, 1, 2, 3], steps=[0, 10], z=[[0.5, 0.5], [0.5, 0.52], [0.65, 0.66], [0.49, 0.5]]
    )
    fig = run.rank_heatmap(grid, Straggler(rank=2, mean=0.655, median=0.5))
    assert "straggler: rank 2 (+31% vs median rank)" in fig.layout.title.text
    (heat,) = fig.data
    assert heat.type == "heatmap" and list(heat.y) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert heat.z[2][0] == pytest.approx(650.0)  # ms
    assert heat.colorbar.title.text == "ms"


def test_a_wide_runs_heatmap_rows_are_blocks_of_ranks_that_link_to_a_rank_view():
    grid = RankGrid(ranks=[0, 16, 32], steps=[0], z=[[0.5], [0.9], [0.5]], block=16,
                    links=["/runs/r/ranks/0", "/runs/r/ranks/16", "/runs/r/ranks/32"])  # fmt: skip
    fig = run.rank_heatmap(grid, Straggler(rank=21, mean=0.9, median=0.5))
    (heat,) = fig.data
    assert list(heat.y) == ["ranks 0-15", "ranks 16-31", "ranks 32-47"]
    assert "max over each block of 16 ranks" in fig.layout.title.text
    assert fig.layout.annotations[0].y == "ranks 16-31"  # the straggler's block
    assert fig.layout.meta["rowLinks"][1] == "/runs/r/ranks/16"


def test_the_heatmap_says_so_when_the_server_found_no_straggler():
    grid = RankGrid(ranks=[0, 1], steps=[0], z=[[0.50], [0.51]])
    fig = run.rank_heatmap(grid, None)
    assert "no straggler" in fig.layout.title.text and not fig.layout.annotations


def test_series_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        Series([0, 1], [1.0])


def test_data_strings_are_escaped_for_plotly_labels():
    fig = run.bandwidth_vs_size({"<b>op</b>": SizePoints([1.0], [1.0])})
    assert fig.data[0].name == "&lt;b&gt;op&lt;/b&gt;"


def test_memory_rank_axis_ticks_whole_positions_only():
    """2 ranks drew ticks at -0.5, 0, 0.5, 1 and 1.5: positions that are no rank."""
    gib = 2**30
    two = run.memory_by_rank(dist([4 * gib, 5 * gib]), {}, {}, {}, stage=1).layout.xaxis
    assert (two.tickmode, two.tick0, two.dtick, two.tickformat) == ("linear", 0, 1, ",d")
    values = [1.0 * gib] * 35
    wide = run.memory_by_rank(dist(values, n=4096, positions=[*range(34), 4095]), {}, {}, {},
                              stage=3).layout.xaxis  # fmt: skip
    assert wide.dtick == 500 and wide.tick0 == 0


def test_memory_log_axis_labels_its_ticks_in_bytes():
    """Plotly's own log ticks read "5 2 100 5 2 10" (the 2s and 5s by their digit alone)."""
    mib = 2**20
    y = run.memory_by_rank(dist([350 * mib, 360 * mib]), {"params": 2 * mib}, {},
                           {"params": 2 * mib}, stage=2).layout.yaxis  # fmt: skip
    assert y.type == "log" and y.tickmode == "array"
    assert list(y.ticktext) == ["1 MiB", "2 MiB", "5 MiB", "10 MiB", "20 MiB", "50 MiB",
                                "100 MiB", "200 MiB", "500 MiB"]  # fmt: skip
    assert list(y.tickvals) == pytest.approx([1, 2, 5, 10, 20, 50, 100, 200, 500])
    # A span of a thousand-fold and more keeps one tick a decade.
    gib = 2**30
    y = run.memory_by_rank(dist([3 * gib]), {"params": 2 * mib}, {}, {}, stage=2).layout.yaxis
    assert list(y.ticktext) == ["1 MiB", "10 MiB", "100 MiB", "1 GiB"]
    assert list(y.tickvals) == pytest.approx([1 / 1024, 10 / 1024, 100 / 1024, 1.0])


def test_bandwidth_vs_size_shows_every_op_where_they_share_sizes_and_bandwidths():
    """A stage-3 step all-gathers and reduce-scatters the same buckets: filled circles of one
    size drew the reduce-scatter on top of every all-gather point."""
    same = SizePoints(sizes=[4e6] * 3, busbw=[1e9] * 3, steps=[0, 1, 2])
    fig = run.bandwidth_vs_size({"all_gather": same, "reduce_scatter": same,
                                 "all_reduce": SizePoints([4e6], [1e9], [0])})  # fmt: skip
    symbols = {t.name: t.marker.symbol for t in fig.data}
    assert set(symbols) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert len(set(symbols.values())) == 3, symbols  # a shape of its own per op
    assert all(s.endswith("-open") for s in symbols.values()), symbols  # outlines see through
    # The op with the most points underneath, the sparser one drawn over it.
    assert [t.name for t in fig.data] == ["all-gather", "reduce-scatter", "all-reduce"]


def test_bandwidth_vs_size_labels_its_size_axis_in_bytes_even_for_one_size():
    """Plotly's log ticks read "5 6 7 8 9 10k 2 3 4": digits alone between the decades."""
    fig = run.bandwidth_vs_size({"all_gather": SizePoints([440_000] * 2, [1e9] * 2, [0, 1])})
    x = fig.layout.xaxis
    lo, hi = x.range
    drawn = [t for v, t in zip(x.tickvals, x.ticktext, strict=True) if 10**lo <= v <= 10**hi]
    assert drawn == ["500 KiB"]  # within the drawn range, around the one size
