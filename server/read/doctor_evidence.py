"""The doctor's evidence: what the checks read about a run, gathered from the read model in a
handful of reads whose cost follows steps, not ranks (see doctor.py for the list)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select
from zerowatch.server import models as m
from zerowatch.server.read import doctor_figures, rollups, runs, series
from zerowatch.server.read.doctor_figures import Figure
from zerowatch.server.read.doctor_settings import DoctorSettings
from zerowatch.server.read.metric_table import ROLLUP_COLUMNS
from zerowatch.server.read.rollups import Stats
from zerowatch.server.read.vocabulary import rank_values_of
from zerowatch.server.settings import Settings

from zerowatch import events as ev

#: Performance metrics read over the window: these names, and every name under a prefix.
PERF_NAMES = ("step_time_s", "busy_s", "exposed_comm_s", "hidden_comm_s", "thread_cpu_s",
              "other_cpu_s", "mfu", "tokens_per_s")  # fmt: skip
PERF_PREFIXES = ("phase.", "part.", "collective.", "offload.", "memory.")
SIGNAL_NAMES = ("loss_scale", "skipped", "nonfinite", "grad_norm", "offload.d2h.bandwidth",
                "offload.h2d.bandwidth")  # fmt: skip
#: The server's default window of a run's recent figures (Settings.recent_steps).
RECENT_STEPS: int = Settings.recent_steps
#: Metrics a straggler's own rows are read for, and the part of the step each belongs to.
RANK_PARTS = {
    "phase.forward": "compute",
    "phase.backward": "compute",
    "phase.optimizer_step": "compute",
    "exposed_comm_s": "communication",
}


@dataclass(kw_only=True)
class Evidence:
    """What the checks read: plain data gathered by `gather`."""

    run: dict[str, Any]
    window: tuple[int, int]
    perf: dict[str, dict[int, Stats]]
    signal_window: tuple[int, int]
    signals: dict[str, dict[int, Stats]]
    totals: dict[str, tuple[float, list[int]]]
    busy_outliers: list[dict[str, Any]]
    hosts: dict[int, str | None]
    #: The worst busy rank's own mean per RANK_PARTS metric over the window.
    rank_means: dict[int, dict[str, float]]
    #: The worst busy rank's busy time per step of the window.
    rank_busy: dict[int, dict[int, float]]
    #: Median seconds between consecutive steps (outside the engine) of a few ranks.
    gaps: dict[int, float]
    #: The worst busy rank's GPU over the window (`gpu_health`), where it sent GPU telemetry.
    rank_gpu: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Where the first non-finite steps began (doctor_crash.origin): first rank and module,
    #: the ranks' local gradient norms, the forward's first non-finite module, batch ids.
    origin: dict[str, Any] = field(default_factory=dict)
    #: The run's recent figures (read/runs.py `recent` over its newest `recent_steps`
    #: steps): the step time and exposed share the findings state (doctor_figures.py).
    recent: dict[str, Any] = field(default_factory=dict)
    recent_steps: int = 0

    @property
    def step_time(self) -> Figure:
        """The run's step time, as every surface names it."""
        return doctor_figures.step_time(self.recent, self.recent_steps)

    @property
    def exposed_share(self) -> Figure:
        """The run's exposed share, as every surface names it."""
        return doctor_figures.exposed_share(self.recent, self.recent_steps)

    def median(self, name: str, stat: str = "p50", *, signals: bool = False) -> float | None:
        """The median over the window's steps of one statistic of a metric."""
        per = (self.signals if signals else self.perf).get(name) or {}
        vals = [st.get(stat) for st in per.values()]
        return statistics.median(vals) if vals else None

    @property
    def mfu(self) -> float | None:
        """The job's MFU over the window: the median over its steps of the mean over ranks
        (each rank reports its share: its model FLOP/s over its device's peak); None where
        no rank knew its device's peak or its model's FLOPs."""
        return self.median("mfu", "mean")

    @property
    def tokens_per_s(self) -> float | None:
        """The job's tokens/s over the window: the median over its steps of the sum over
        ranks."""
        per = self.perf.get("tokens_per_s") or {}
        vals = [st.mean * st.n for st in per.values()]
        return statistics.median(vals) if vals else None

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.perf if n.startswith(prefix) and self.perf[n])


def _window(bounds: tuple[int, int], size: int, warmup: int) -> tuple[int, int]:
    first, last = bounds
    lo = max(first, last - size + 1)
    if last - first + 1 > warmup + 1:
        lo = max(lo, first + warmup)
    return lo, last


def _typical_rank(per_step: dict[int, Stats], attr: str) -> int | None:
    got = Counter(int(getattr(st, attr)) for st in per_step.values())
    return got.most_common(1)[0][0] if got else None


def step_gaps(
    conn: Connection, pk: int, ranks: list[int], step_from: int, step_to: int
) -> dict[int, float]:
    """{rank: median seconds between the end of a step and the start of the next} over
    consecutive steps in the range: the time a rank spends outside the engine."""
    s = m.steps.c
    rows = conn.execute(
        select(s.rank, s.step, s.time, s.step_time_s)
        .where(s.run == pk, s.rank.in_(ranks), s.step >= step_from - 1, s.step <= step_to)
        .order_by(s.rank, s.step)
    ).all()
    ends: dict[tuple[int, int], float] = {}
    for r in rows:
        ends[(int(r.rank), int(r.step))] = float(r.time)
    out: dict[int, float] = {}
    for rank in ranks:
        gaps = [
            float(r.time) - float(r.step_time_s) - ends[(rank, int(r.step) - 1)]
            for r in rows
            if int(r.rank) == rank and (rank, int(r.step) - 1) in ends and r.step >= step_from
        ]
        if gaps:
            out[rank] = statistics.median(gaps)
    return out


def _rank_values(conn: Connection, pk: int, rank: int, lo: int, hi: int) -> dict[int, dict]:
    """{step: every metric of the steps row} of one rank in [lo, hi] (its newest row of a
    step where a restart replayed it)."""
    s = m.steps.c
    rows = conn.execute(
        select(*(s[c] for c in ROLLUP_COLUMNS))
        .where(s.run == pk, s.rank == rank, s.step >= lo, s.step <= hi)
        .order_by(s.seq)
    ).all()
    values = rank_values_of([r._mapping for r in rows], [() for _ in rows])
    return {int(r.step): v for r, v in zip(rows, values, strict=True)}


def gpu_health(per_step: dict[int, dict[str, float]]) -> dict[str, Any] | None:
    """One rank's GPU over its steps ({step: its metrics}), or None without GPU telemetry:
    the steps with telemetry, the share of them throttled and of each slowing reason, the
    mean SM clock ratio, temperature and power over its limit, and the XID and ECC errors
    counted (the newest counts: they are since the agent attached)."""
    have = {st: v for st, v in per_step.items() if any(k.startswith("gpu.") for k in v)}
    if not have:
        return None
    n = len(have)

    def mean(name: str) -> float | None:
        vals = [v[name] for v in have.values() if name in v]
        return statistics.fmean(vals) if vals else None

    newest = have[max(have)]
    reasons = {
        name: sum(1 for v in have.values() if v.get(f"gpu.reason.{name}") == 1.0) / n
        for name in ev.GPU_REASON_LABELS
    }
    return {
        "steps": n,
        "throttled_share": sum(1 for v in have.values() if v.get("gpu.throttled") == 1.0) / n,
        "reasons": {k: v for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]) if v > 0},
        "sm_clock_ratio": mean("gpu.sm_clock_ratio"),
        "temperature_c": mean("gpu.temperature_c"),
        "power_ratio": mean("gpu.power_ratio"),
        "xid_errors": int(newest.get("gpu.xid_errors", 0)),
        "ecc_errors": int(newest.get("gpu.ecc_errors", 0)),
    }


def gather(
    conn: Connection,
    pk: int,
    run: dict[str, Any],
    settings: DoctorSettings,
    *,
    recent_steps: int = RECENT_STEPS,
) -> Evidence | None:
    """The run's evidence (see the module docstring), or None for a run without steps.
    `recent_steps`: the server's window of a run's recent figures (Settings.recent_steps)."""
    bounds = rollups.step_bounds(conn, pk)
    if bounds is None:
        return None
    lo, hi = _window(bounds, int(settings.window_steps), int(settings.warmup_steps))
    names = rollups.metric_names(conn, pk)
    if not names:  # nothing rolled up yet: the reader computes the dirty steps itself
        perf_names = None
    else:
        perf_names = [n for n in names if n in PERF_NAMES or n.startswith(PERF_PREFIXES)]
    perf = rollups.read(conn, pk, perf_names, step_from=lo, step_to=hi)
    if perf_names is None:
        perf = {n: v for n, v in perf.items() if n in PERF_NAMES or n.startswith(PERF_PREFIXES)}
    s_lo, _ = _window(bounds, int(settings.signal_steps), int(settings.warmup_steps))
    s_lo = min(s_lo, lo)
    signals = rollups.read(conn, pk, list(SIGNAL_NAMES), step_from=s_lo, step_to=hi)
    outl = series.outliers(conn, pk, "busy_s", k=8, step_from=lo, step_to=hi)
    rank_means: dict[int, dict[str, float]] = {}
    rank_busy: dict[int, dict[int, float]] = {}
    rank_gpu: dict[int, dict[str, Any]] = {}
    if outl and int(run["world_size"]) > 1:
        worst = int(outl[0]["rank"])
        wanted = [n for n in (*RANK_PARTS, "busy_s") if perf.get(n)]
        # Every wanted metric is a column (or part of one) of the steps rows: one read of
        # the rank's rows in the window, each turned into its metrics at once.
        per_step = _rank_values(conn, pk, worst, lo, hi)
        rank_means[worst] = {}
        health = gpu_health(per_step)
        if health is not None:
            rank_gpu[worst] = health
        for name in wanted:
            vals = [v[name] for v in per_step.values() if name in v]
            if name == "busy_s":
                rank_busy[worst] = {st: v[name] for st, v in per_step.items() if name in v}
            if vals:
                rank_means[worst][name] = statistics.fmean(vals)
    exposed = perf.get("exposed_comm_s") or {}
    candidates = {0}
    for attr in ("min_rank", "max_rank"):
        r = _typical_rank(exposed, attr)
        if r is not None:
            candidates.add(r)
    gaps = step_gaps(conn, pk, sorted(candidates), lo, hi)
    hosts = series.host_map(conn, pk, sorted({int(o["rank"]) for o in outl} | set(gaps)))
    return Evidence(
        run=run, window=(lo, hi), perf=perf, signal_window=(s_lo, hi), signals=signals,
        totals=rollups.totals(conn, pk), busy_outliers=outl, hosts=hosts,
        rank_means=rank_means, rank_busy=rank_busy, gaps=gaps, rank_gpu=rank_gpu,
        recent=runs.recent(conn, pk, recent_steps=recent_steps), recent_steps=recent_steps,
    )  # fmt: skip


__all__ = ["PERF_NAMES", "PERF_PREFIXES", "RANK_PARTS", "SIGNAL_NAMES", "Evidence", "gather",
           "gpu_health", "step_gaps"]  # fmt: skip
