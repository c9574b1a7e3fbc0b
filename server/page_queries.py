"""Reads for the HTML pages, as dashboards.data, built on the one read model (read/).

A run page draws a dozen charts at the same *sample steps* (at most `MAX_POINTS`, evenly
spaced over the run), each value the median over ranks of that step (the rollups' p50, the
figure the API's stats series and /metrics' `stat="p50"` give too). The rank heatmap
comes from `read.series.rank_heatmap` (blocks of ranks for a wide run; its straggler is the
doctor's, which pages.py adds from the findings); the
compare page's figures from `read.compare`, the same function as `/api/v1/compare`. So the
cost of a page follows the steps drawn, not the ranks.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from sqlalchemy import func, select
from zerowatch.dashboards.data import (
    Quantiles,
    RankDistribution,
    RankGrid,
    RunSummary,
    RunView,
    Series,
    SizePoints,
)  # fmt: skip
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read import compare as compare_read
from zerowatch.server.read import rollups, runs, series
from zerowatch.server.read.rollups import Stats

from zerowatch import events as ev

#: Most sample steps a chart draws.
MAX_POINTS = 400
#: The rollups the run page draws (metric names, or prefixes of them).
DRAWN = (
    "step_time_s", "busy_s", "exposed_comm_s", "hidden_comm_s", "phase.", "part.", "offload.",
    "grad_norm", "loss", "lr",
    "loss_scale", "clipped", "skipped",
    *(f"collective.{op}.{f}" for op in ev.COLLECTIVE_OPS
      for f in ("latency_s", "busbw", "bytes", "count")),
)  # fmt: skip
#: The metrics drawn as their distribution over ranks (median, p10-p90, min-max bands).
SPREAD = (
    "step_time_s", "busy_s", "exposed_comm_s", *(f"phase.{p}" for p in ev.PHASES),
    *(f"collective.{op}.{f}" for op in ev.COLLECTIVE_OPS for f in ("latency_s", "busbw")),
)  # fmt: skip
#: Most rank-steps the run page's heatmap reads (the one chart that reads rank rows: its
#: cost follows the ranks): the newest 8 steps of a 4,096-rank run, 32 of 1,024 ranks, every
#: sampled step up to 81 ranks. The bands over ranks cover the whole run from the rollups.
HEATMAP_RANK_STEPS = 32_768
#: How far back from the newest step the memory chart looks for a step that measured memory
#: (agents measure it every 10th step by default).
MEMORY_WINDOW = 50


def sample_steps(first: int, last: int, n: int) -> list[int]:
    """At most `n` steps evenly spaced from `first` to `last`, both included."""
    if last < first:
        return []
    span = last - first + 1
    if span <= n:
        return list(range(first, last + 1))
    if n <= 1:
        return [last]
    return sorted({first + round(i * (span - 1) / (n - 1)) for i in range(n)})


def _p50(per_step: dict[int, Stats], steps: list[int], *, gaps: bool = False) -> Series:
    """The median over ranks at the sampled steps that have a rollup; `gaps`: at every
    sampled step, None where it has none (a line breaks there instead of drawing across)."""
    return _stat(per_step, steps, "p50", gaps)


def _mean(per_step: dict[int, Stats], steps: list[int], *, gaps: bool = False) -> Series:
    """The mean over ranks, as `_p50`."""
    return _stat(per_step, steps, "mean", gaps)


def _stat(per_step: dict[int, Stats], steps: list[int], stat: str, gaps: bool) -> Series:
    xs = steps if gaps else [s for s in steps if s in per_step]
    return Series(xs, [getattr(per_step[s], stat) if s in per_step else None for s in xs])


def run_view(
    *,
    db: Database,
    run_id: str,
    max_points: int = MAX_POINTS,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
) -> RunView | None:
    """The run page's data (see the module docstring), or None for an unknown run."""
    run = runs.get_run(db=db, run_id=run_id, stalled_after_s=stalled_after_s,
                       recent_steps=recent_steps, ranks=False)  # fmt: skip
    if run is None:
        return None
    view = RunView(run=run, theory={k: float(v) for k, v in (run.get("theory") or {}).items()})
    with db.read() as conn:
        pk = runs.run_pk(conn, run_id)
        bounds = rollups.step_bounds(conn, pk) if pk is not None else None
        if pk is None or bounds is None:
            return view
        steps = sample_steps(bounds[0], bounds[1], max_points)
        # What the run has rollups of, cut to what the page draws; a run whose steps are
        # all still being rolled up (a fresh live run) reads everything it has.
        names = [n for n in rollups.metric_names(conn, pk) if n.startswith(DRAWN)]
        got = rollups.read(conn, pk, names or None, steps_in=steps)
        memory = _memory(conn, pk, bounds[1])
    view.last_step = bounds[1]
    have = got.get("step_time_s", {})
    view.steps = sorted(have)
    # Sampled steps between the first and the last that have a rollup but no step time
    # (still being rolled up after an upload, or never stored): said on the page, and a gap
    # in the lines over steps.
    view.missing_steps = [x for x in steps if x not in have and view.steps
                          and view.steps[0] < x < view.steps[-1]]  # fmt: skip
    st = view.steps
    lines = sorted({*st, *view.missing_steps})
    none: dict[int, Stats] = {}
    view.step_time = _p50(got.get("step_time_s", none), lines, gaps=True)
    view.exposed_comm = _p50(got.get("exposed_comm_s", none), lines, gaps=True)
    # (Stacked areas would fall to zero at a gap: they keep the steps they have.)
    view.phases = {p: _p50(got[f"phase.{p}"], st) for p in ev.PHASES if got.get(f"phase.{p}")}
    # The stack of exclusive parts: means over ranks, which add up to the mean step time.
    view.parts = {p: _mean(got[f"part.{p}"], st) for p in ev.STEP_PARTS
                  if got.get(f"part.{p}")}  # fmt: skip
    if view.parts:  # (the stack keeps the steps it has; the lines beside it show the gaps)
        view.step_time_mean = _mean(got.get("step_time_s", none), lines, gaps=True)
        view.hidden_comm = _mean(got.get("hidden_comm_s", none), lines, gaps=True)
    view.offload = {d: _p50(got[f"offload.{d}.bandwidth"], st) for d in ("d2h", "h2d")
                    if got.get(f"offload.{d}.bandwidth")}  # fmt: skip
    for name in SPREAD:
        per = got.get(name, none)
        xs = [s for s in st if s in per]
        if xs:
            view.spread[name] = {
                stat: Series(xs, [per[s].get(stat) for s in xs])
                for stat in ("min", "p10", "p50", "p90", "max")
            }
    view.grad_norm = _p50(got.get("grad_norm", none), st)
    view.loss = _p50(got.get("loss", none), st)
    view.lr = _p50(got.get("lr", none), st)
    view.loss_scale = _p50(got.get("loss_scale", none), st)
    view.clipped_steps = [s for s, v in got.get("clipped", none).items() if v.max > 0]
    view.skipped_steps = [s for s, v in got.get("skipped", none).items() if v.max > 0]
    for op in ev.COLLECTIVE_OPS:
        lat = got.get(f"collective.{op}.latency_s")
        if not lat:
            continue
        view.latency[op] = _p50(lat, st)
        view.busbw[op] = _p50(got.get(f"collective.{op}.busbw", none), st)
        nbytes, count = (
            got.get(f"collective.{op}.bytes", none),
            got.get(f"collective.{op}.count", none),
        )
        bw = got.get(f"collective.{op}.busbw", none)
        pts = [s for s in st if s in nbytes and s in count and s in bw and count[s].p50 > 0]
        view.sizes[op] = SizePoints([nbytes[s].p50 / count[s].p50 for s in pts],
                                    [bw[s].p50 for s in pts], pts)  # fmt: skip
    (view.memory_peak, view.memory_state, view.memory_phases, view.capacity_bytes, theory,
     view.memory_reserved) = memory  # fmt: skip
    if theory and not view.theory:
        view.theory = theory
    view.outliers = _outliers(db, pk, int(run["world_size"]), bounds[1])
    world = max(int(run["world_size"]), 1)
    heat = series.rank_heatmap(db=db, run_id=run_id, metric="busy_s",
                               max_steps=max(1, min(len(st), HEATMAP_RANK_STEPS // world)))  # fmt: skip
    if heat is not None:
        rid = quote(run_id, safe="")
        view.heat = RankGrid(heat["ranks"], heat["steps"], heat["z"], block=int(heat["block"]),
                             links=[f"/runs/{rid}/ranks/{r}" for r in heat["top_ranks"]])  # fmt: skip
    return view


#: The newest steps over which ranks are found to stand out.
OUTLIER_STEPS = 100
#: How far from the run's median (as a fraction) a rank must be to be listed.
STANDS_OUT = 0.05
#: What the outlier table lists, per kind: (metric, low values stand out?, how many, label).
OUTLIER_KINDS = (
    ("busy_s", False, 5, "slowest busy time"),
    ("memory.peak", False, 2, "highest memory peak"),
    ("collective.all_gather.busbw", True, 2, "lowest all-gather bus bandwidth"),
    ("collective.reduce_scatter.busbw", True, 2, "lowest reduce-scatter bus bandwidth"),
)


def _outliers(db: Database, pk: int, world: int, last: int) -> list[dict[str, Any]]:
    """The ranks that stand out over the newest OUTLIER_STEPS steps, from the rollups'
    outlier lists (read.series.outliers): a few per kind, with their hosts; none for a
    one-rank run. A fixed window: its cost is the same for a run of a million steps."""
    if world < 2:
        return []
    first = max(0, last - OUTLIER_STEPS + 1)
    out: list[dict[str, Any]] = []
    with db.read() as conn:
        for metric, low, k, label in OUTLIER_KINDS:
            for o in series.outliers(conn, pk, metric, k=k, step_from=first, low=low):
                ratio = o["mean"] / o["median"] if o["median"] else None
                if ratio is None or (ratio > 1 - STANDS_OUT if low else ratio < 1 + STANDS_OUT):
                    continue  # not out on the side that matters: not worth a row
                out.append({"rank": o["rank"], "what": label, "value": o["mean"],
                            "median": o["median"], "ratio": ratio, "metric": metric})  # fmt: skip
        hosts = series.host_map(conn, pk, sorted({o["rank"] for o in out}))
    for o in out:
        o["host"] = hosts.get(o["rank"])
    return out


def distribution(st: Stats, step: int) -> RankDistribution:
    """A metric's distribution over ranks at one step, from its rollup with the outlier
    lists (`extra`): every rank where the lists hold them all (up to 2 x ReadTuning.top_k
    ranks), else the lowest and highest ranks with the p10, median and p90 between."""
    lo = sorted((float(v), int(r)) for r, v in st.extra.get("lo", []))
    hi = sorted((float(v), int(r)) for r, v in st.extra.get("hi", []))
    if not lo or not hi:  # no lists (a one-rank run): the ends the rollup names
        lo, hi = [(st.min, st.min_rank)], [(st.max, st.max_rank)]
    pairs = sorted({r: (v, r) for v, r in (*lo, *hi)}.values())
    points: list[tuple[float, float, int | None]]
    if len(pairs) >= st.n:  # every rank is in the lists
        points = [(float(i), v, r) for i, (v, r) in enumerate(pairs)]
    else:
        top = st.n - len(hi)
        points = [(float(i), v, r) for i, (v, r) in enumerate(lo)]
        for q in ("p10", "p50", "p90"):
            at = float(q[1:]) / 100 * (st.n - 1)
            if points[-1][0] < at < top:
                points.append((at, st.get(q), None))
        points += [(float(top + i), v, r) for i, (v, r) in enumerate(hi)]
    return RankDistribution(n=st.n, step=step, positions=[p[0] for p in points],
                            values=[p[1] for p in points], ranks=[p[2] for p in points])  # fmt: skip


def _memory(
    conn: Any, pk: int, last: int
) -> tuple[
    RankDistribution | None, dict[str, float], dict[str, Quantiles], float | None,
    dict[str, float], tuple[float, float] | None,
]:  # fmt: skip
    """Memory over ranks at the newest step that measured it (within MEMORY_WINDOW steps):
    the peak's distribution, the median rank's model state by kind, each phase's peak, the
    capacity the agents reported, the theory's model state by kind and the allocator's
    reserved bytes (median and highest rank; None where not reported) (from the rollups:
    the cost does not grow with the ranks)."""
    first = max(0, last - MEMORY_WINDOW + 1)
    peak = rollups.read(conn, pk, ["memory.peak"], step_from=first, step_to=last)["memory.peak"]
    if not peak:
        return None, {}, {}, None, {}, None
    step = max(peak)
    # Every metric of that one step (a hundred rollups; the live steps included).
    got = rollups.read(conn, pk, None, steps_in=[step], extra=True)

    def p50s(prefix: str) -> dict[str, float]:
        return {name.removeprefix(prefix): per[step].p50 for name, per in got.items()
                if name.startswith(prefix) and step in per}  # fmt: skip

    phases = {
        name.removeprefix("memory.peak."): Quantiles(st.min, st.p10, st.p50, st.p90, st.max)
        for name, per in got.items()
        if name.startswith("memory.peak.") and (st := per.get(step)) is not None
    }
    cap = got.get("memory.capacity", {}).get(step)
    res = got.get("memory.reserved", {}).get(step)
    return (
        distribution(got["memory.peak"][step], step),
        p50s("memory.state."),
        phases,
        cap.max if cap is not None and cap.max > 0 else None,
        p50s("memory.theory."),
        (res.p50, res.max) if res is not None and res.max > 0 else None,
    )


#: Projects the runs page's filter offers at most (those of the newest runs).
MAX_PROJECTS = 200


def projects(*, db: Database) -> list[str]:
    """The projects of the newest runs, at most MAX_PROJECTS, sorted (the runs page's
    filter; any other project is reached by its URL)."""
    r = m.runs.c
    newest = func.max(r.created_at)
    with db.read() as conn:
        rows = conn.execute(
            select(r.project).group_by(r.project).order_by(newest.desc()).limit(MAX_PROJECTS)
        )
        return sorted(row.project for row in rows)


# -- compare --------------------------------------------------------------------------------


def run_summary(
    *, db: Database, run_id: str, window: int = 100, stalled_after_s: float = 120.0
) -> tuple[dict[str, Any], RunSummary] | None:
    """A run's compare figures (read.compare, as /api/v1/compare gives them)."""
    run = runs.get_run(db=db, run_id=run_id, stalled_after_s=stalled_after_s, ranks=False)
    if run is None:
        return None
    got = compare_read.compare(db=db, run_ids=[run_id], window=window)["runs"]
    if not got:
        return None
    c = got[0]
    summary = RunSummary(
        run_id=run["run_id"],
        name=run["name"],
        zero_stage=int(run["zero_stage"]),
        world_size=int(run["world_size"]),
        model_state={k: float(v) for k, v in c["model_state_bytes"]["measured"].items()},
        model_state_theory={k: float(v) for k, v in (run.get("theory") or {}).items()},
        comm_bytes={k: float(v) for k, v in c["comm_bytes_per_step"]["measured"].items()
                    if v is not None},
        comm_bytes_theory={k: float(v) for k, v in (run.get("theory_comm") or {}).items()},
        phases={p: float(v) for p, v in c["phases_s"].items() if v is not None},
        parts={p: float(v) for p, v in c["parts_s"].items() if v is not None},
        hidden_comm_s=c["hidden_comm_s"],
        step_time_s=c["step_time_s"],
        step_time_mean_s=c.get("step_time_mean_s"),
        samples_per_s=c["samples_per_s"],
    )  # fmt: skip
    return run, summary


__all__ = ["MAX_POINTS", "SPREAD", "distribution", "projects", "run_summary", "run_view",
           "sample_steps"]  # fmt: skip
