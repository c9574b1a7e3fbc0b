"""`/metrics`: a prometheus-client Collector over the read model, bounded per run.

Each scrape reads the database (not this process's memory), so every server process of a
deployment answers the same, whichever ingested what. Per live run it reads the newest
step's rollups, the run's totals, and the rows of a few outlier ranks: a handful of
indexed queries, whatever the world size.

What a run exposes (names from `events.METRICS`; docs/metrics.md lists each):

- rank statistics of the newest rolled-up step (a step whose ranks have arrived; the newest
  step at all while nothing is rolled up), label `stat` in `STATS` (min, p50, p90, max, mean),
  for every gauge: step time, busy time, phases, exclusive parts, exposed and hidden
  communication, bus bandwidth and bytes per op, offload bandwidth, memory peaks,
  model-state bytes and their theory, grad norm, loss, loss scale, throughput; the
  throughput gauges also `stat="sum"` (mean × ranks reporting): the job's samples/s;
- per-rank series (label `rank`, `stat` empty) only for the `top_k` ranks that stand out
  in busy time over the newest `OUTLIER_WINDOW` steps: the scalar gauges, phases and parts;
- one latency histogram per op, summed over ranks and cumulative over the run;
- counters per run: rank-steps stored, steps skipped (fp16 overflow), non-finite steps;
- the run's newest checkpoint save and load (label `op`): the slowest rank's seconds, the
  bytes of every rank, the bandwidth (read/jobs.py).

A gauge family has both `stat` and `rank` labels; one of them is empty on each series
(Prometheus drops empty labels), so `zerowatch_step_time_seconds{stat="p50"}` is the run's
median and `zerowatch_step_time_seconds{rank="17"}` an outlier rank's own value. A 4,096-rank
run exposes a few hundred series, and so does a 2-rank run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Connection, func, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.heartbeats import read_heartbeats
from zerowatch.server.read import forensics, jobs, metric_table, rollups, runs, series
from zerowatch.server.read.rollups import Stats
from zerowatch.server.read.vocabulary import rank_values_of

from zerowatch import events as ev

M = ev.METRICS
BUCKET_BOUNDS = [*(repr(float(b)) for b in ev.LATENCY_BUCKETS), "+Inf"]
#: The rank statistics exposed per gauge: a rollup's (metric_table.STATS) but p10.
STATS = tuple(s for s in metric_table.STATS if s != "p10")
#: Gauges that also expose `stat="sum"`, the job's total over its ranks.
SUMMED = ("samples_per_second", "tokens_per_second")
#: Steps over which the outlier ranks are chosen.
OUTLIER_WINDOW = 10
#: Live runs a scrape exposes at most (Settings.metrics_max_runs), the most recently
#: active first: a scrape costs a few queries a run, and must stay well inside Prometheus'
#: 10 s scrape timeout however many runs were created.
MAX_RUNS = 256

RUN = ["run", "project"]
GAUGE = ["run", "project", "stat", "rank"]

#: Plain gauges: key in events.METRICS -> (vocabulary metric, documentation).
SCALARS = {
    "step_time": ("step_time_s", "Wall-clock time of the newest optimizer step."),
    "busy": ("busy_s", "Step time less exposed communication: the time a rank computes."),
    "optimizer_step": (
        "phase.optimizer_step",
        "Time of the optimizer step phase in the newest step (CPU Adam when offloaded).",
    ),
    "exposed_comm": ("exposed_comm_s", "Communication time compute did not hide."),
    "hidden_comm": ("hidden_comm_s", "Communication time that ran under compute."),
    "grad_norm": ("grad_norm", "Global gradient norm before clipping."),
    "loss": ("loss", "Training loss reported for the newest step."),
    "loss_scale": ("loss_scale", "Dynamic loss scale (fp16)."),
    "samples_per_second": ("samples_per_s", "Samples per second of a rank."),
    "tokens_per_second": ("tokens_per_s", "Tokens per second of a rank."),
    "mfu": (
        "mfu",
        "Model FLOPs utilisation of a rank: its model FLOP/s over its device's "
        "peak; stat=mean is the job's.",
    ),
    "memory_capacity": ("memory.capacity", "Memory capacity of a rank's device."),
    # GPU health (NVML, sampled by the agent; docs/gpu.md)
    "gpu_sm_clock_ratio": ("gpu.sm_clock_ratio", "SM clock of a rank's GPU over its maximum."),
    "gpu_throttled_fraction": (
        "gpu.throttled_fraction",
        "Share of the step's NVML samples in which a rank's GPU was throttled.",
    ),
    "gpu_temperature": ("gpu.temperature_c", "Temperature of a rank's GPU, degrees Celsius."),
    "gpu_power": ("gpu.power_w", "Power drawn by a rank's GPU, watts."),
    "gpu_power_limit_ratio": ("gpu.power_ratio", "Power of a rank's GPU over its power limit."),
}
#: Keyed gauges: key in events.METRICS -> (vocabulary prefix, label, documentation, per rank).
KEYED = {
    "phase": ("phase.", "phase", "Time of each phase (phases nest: see docs/timing.md).", True),
    "step_part": ("part.", "part", "Exclusive parts of the step; they add up to it.", True),
    "collective_busbw": ("collective.*.busbw", "op", "Bus bandwidth (nccl-tests) per op.", False),
    "collective_bytes": ("collective.*.bytes", "op", "Bytes (nccl-tests size) per op.", False),
    "offload_bw": ("offload.*.bandwidth", "direction", "Host-device copy bandwidth.", False),
    "memory_peak": ("memory.peak.", "phase", "Peak memory of each phase.", False),
    "model_state": ("memory.state.", "kind", "Model-state bytes held, by kind.", False),
    "model_state_theory": (
        "memory.theory.",
        "kind",
        "Model-state bytes the ZeRO model predicts, by kind.",
        False,
    ),
}


def _keyed(metric: str, prefix: str) -> str | None:
    """The label value of `metric` under a KEYED prefix, or None."""
    if "*" in prefix:
        head, tail = prefix.split("*")
        if metric.startswith(head) and metric.endswith(tail):
            mid = metric[len(head) : len(metric) - len(tail)]
            return mid if mid and "." not in mid else None
        return None
    if metric.startswith(prefix):
        rest = metric[len(prefix) :]
        return rest if rest and "." not in rest else None
    return None


class _Families:
    def __init__(self) -> None:
        self.info = GaugeMetricFamily(
            M["run_info"], "Run description; value 1.",
            labels=[*RUN, "name", "stage", "precision", "offload_optimizer", "offload_param",
                    "engine", "world_size"],
        )  # fmt: skip
        self.running = GaugeMetricFamily(
            M["run_running"], "1 while the run has not ended (also when stalled), else 0.",
            labels=RUN,
        )  # fmt: skip
        self.last = GaugeMetricFamily(
            M["last_event"], "Unix time of the run's newest event.", labels=RUN
        )
        self.steps = CounterMetricFamily(M["steps"], "Rank-steps stored for the run.", labels=RUN)
        self.skipped = CounterMetricFamily(
            M["skipped_steps"], "Optimizer steps skipped (fp16 overflow) on any rank.",
            labels=RUN,
        )  # fmt: skip
        self.nonfinite = CounterMetricFamily(
            M["nonfinite"], "Steps with a non-finite loss or gradient on any rank.", labels=RUN
        )
        self.latency = HistogramMetricFamily(
            M["collective_latency"],
            "Latency of collective calls, summed over ranks, cumulative over the run.",
            labels=[*RUN, "op"],
        )
        self.gpu_throttled = GaugeMetricFamily(
            M["gpu_throttled_ranks"],
            "Ranks whose GPU was throttled (power cap, thermal, hardware slowdown) in the "
            "newest step.",
            labels=RUN,
        )  # fmt: skip
        self.gpu_xid = CounterMetricFamily(
            M["gpu_xid_errors"], "Critical XID events of the run's GPUs since their agents "
            "attached, summed over ranks.", labels=RUN,
        )  # fmt: skip
        self.gpu_ecc = CounterMetricFamily(
            M["gpu_ecc_errors"], "Uncorrected ECC errors of the run's GPUs since their agents "
            "attached, summed over ranks.", labels=RUN,
        )  # fmt: skip
        self.hung = GaugeMetricFamily(
            M["hung_ranks"], "Ranks the hang finding names (not in the collective the other "
            "ranks wait in, or silent; 1 where every rank waits in it), 0 without a hang.",
            labels=RUN,
        )  # fmt: skip
        self.checkpoint_seconds = GaugeMetricFamily(
            M["checkpoint_seconds"], "The run's newest checkpoint save or load (op): the "
            "slowest rank's seconds.", labels=[*RUN, "op"],
        )  # fmt: skip
        self.checkpoint_bytes = GaugeMetricFamily(
            M["checkpoint_bytes"], "The run's newest checkpoint save or load (op): bytes "
            "written or read, summed over ranks.", labels=[*RUN, "op"],
        )  # fmt: skip
        self.checkpoint_bandwidth = GaugeMetricFamily(
            M["checkpoint_bandwidth"], "The run's newest checkpoint save or load (op): its "
            "bytes over the slowest rank's seconds.", labels=[*RUN, "op"],
        )  # fmt: skip
        self.scalars = {k: GaugeMetricFamily(M[k], doc, labels=GAUGE)
                        for k, (_, doc) in SCALARS.items()}  # fmt: skip
        self.keyed = {k: GaugeMetricFamily(M[k], doc, labels=[*GAUGE, label])
                      for k, (_, label, doc, _) in KEYED.items()}  # fmt: skip

    def all(self) -> Iterator[Metric]:
        yield from (self.info, self.running, self.last, self.steps, self.skipped,
                    self.nonfinite, self.latency, self.gpu_throttled, self.gpu_xid,
                    self.gpu_ecc, self.hung, self.checkpoint_seconds,
                    self.checkpoint_bytes, self.checkpoint_bandwidth)  # fmt: skip
        yield from self.scalars.values()
        yield from self.keyed.values()


def _add_values(
    fam: _Families, run: list[str], values: dict[str, float], *, stat: str, rank: str,
    per_rank: bool,
) -> None:  # fmt: skip
    for key, (metric, _) in SCALARS.items():
        v = values.get(metric)
        if v is not None:
            fam.scalars[key].add_metric([*run, stat, rank], v)
    for name, v in values.items():
        for key, (prefix, _, _, on_ranks) in KEYED.items():
            if per_rank and not on_ranks:
                continue
            label = _keyed(name, prefix)
            if label is not None:
                fam.keyed[key].add_metric([*run, stat, rank, label], v)


def _outlier_values(conn: Connection, pk: int, ranks: list[int], step: int) -> dict[int, dict]:
    """The outlier ranks' own values at `step` (their rows, by the (run, step) index)."""
    if not ranks:
        return {}
    s = m.steps.c
    cols = [s[c] for c in metric_table.ROLLUP_COLUMNS]
    rows = conn.execute(select(*cols).where(s.run == pk, s.step == step, s.rank.in_(ranks))).all()
    values = rank_values_of([r._mapping for r in rows], [() for _ in rows])
    return {int(r.rank): v for r, v in zip(rows, values, strict=True)}


def _collect_run(conn: Connection, fam: _Families, row: Any, *, top_k: int, now: float) -> None:
    pk = int(row.id)
    run = [row.run_id, row.project]
    fam.info.add_metric(
        [*run, row.name, str(row.zero_stage), row.precision, row.offload_optimizer,
         row.offload_param, row.engine, str(row.world_size)], 1.0,
    )  # fmt: skip
    fam.running.add_metric(run, 1.0 if row.status == "running" else 0.0)
    if row.status == "running":
        fam.hung.add_metric(run, _hung_ranks(conn, pk, int(row.world_size), now))
    if row.last_event_at is not None:
        fam.last.add_metric(run, min(row.last_event_at, now))
    stored = conn.execute(
        select(func.coalesce(func.sum(m.rank_states.c.steps), 0)).where(m.rank_states.c.run == pk)
    ).scalar()
    fam.steps.add_metric(run, float(stored or 0))
    for op, call in jobs.latest_calls(conn, pk).items():
        fam.checkpoint_seconds.add_metric([*run, op], call["seconds"])
        if call["bytes"] is not None:
            fam.checkpoint_bytes.add_metric([*run, op], float(call["bytes"]))
        if call["bandwidth_bytes_per_s"] is not None:
            fam.checkpoint_bandwidth.add_metric([*run, op], call["bandwidth_bytes_per_s"])
    tot = rollups.totals(conn, pk)
    fam.skipped.add_metric(run, tot.get(rollups.SKIPPED, (0.0, []))[0])
    fam.nonfinite.add_metric(run, tot.get(rollups.NONFINITE, (0.0, []))[0])
    for op in ev.COLLECTIVE_OPS:
        value, buckets = tot.get(rollups.hist_key(op), (0.0, []))
        if not buckets:
            continue
        cum, acc = [], 0
        for bound, n in zip(BUCKET_BOUNDS, buckets, strict=True):
            acc += n
            cum.append((bound, acc))
        fam.latency.add_metric([*run, op], cum, value)
    # The newest step the roll-up worker has rolled up: its ranks have arrived (a step still
    # arriving would show part of its distribution) and reading it costs a row per metric.
    # Its stored rollups are read as the roll-up worker left them (a late rank that marked it
    # dirty again shows after the roll-up worker's next pass), so such a scrape never computes
    # steps from rows. A run with nothing rolled up yet shows its newest step, computed
    # from its rows.
    step = rollups.newest_rolled_up(conn, pk, "step_time_s")
    live = step is None
    if step is None:
        if rollups.in_backlog(conn, pk, int(row.world_size or 1)):
            # Nothing rolled up yet and a backlog (a recovery storm's first seconds): the
            # newest steps are partial, and computing them from thousands of rank rows
            # would take a scrape past a second. The rank statistics wait for the first rolled-up step.
            return
        newest = rollups.newest_steps(conn, pk, "step_time_s", 1)
        if not newest:
            return
        step = newest[0]
    got: dict[str, dict[int, Stats]] = rollups.read(conn, pk, None, steps_in=[step], live=live)
    for stat in STATS:
        values = {name: per[step].get(stat) for name, per in got.items() if step in per}
        _add_values(fam, run, values, stat=stat, rank="", per_rank=False)
    for key in SUMMED:  # mean × n: the sum over the ranks that reported the step
        st = got.get(SCALARS[key][0], {}).get(step)
        if st is not None:
            fam.scalars[key].add_metric([*run, "sum", ""], st.mean * st.n)
    _collect_gpu(conn, fam, run, pk, got, step, live=live)
    if top_k and row.world_size > 1:
        ranks = [
            o["rank"]
            for o in series.outliers(
                conn, pk, "busy_s", k=top_k, step_from=step - OUTLIER_WINDOW + 1, step_to=step,
                low=False, live=live,
            )
        ]  # fmt: skip
        for rank, values in sorted(_outlier_values(conn, pk, ranks, step).items()):
            _add_values(fam, run, values, stat="", rank=str(rank), per_rank=True)


def _hung_ranks(conn: Connection, pk: int, world_size: int, now: float) -> float:
    """The ranks the run's hang finding names, from its heartbeats (read/forensics.py)."""
    found = forensics.hang(read_heartbeats(conn, pk), world_size=world_size, now=now)
    return float(max(len(found[0].ranks), 1)) if found else 0.0


def _collect_gpu(
    conn: Connection, fam: _Families, run: list[str], pk: int,
    got: dict[str, dict[int, Stats]], step: int, *, live: bool,
) -> None:  # fmt: skip
    """The run's GPU series, where its ranks send GPU telemetry: the ranks throttled in the
    newest step, and the XID and ECC error counts summed over ranks. A count is the highest
    sum over the newest OUTLIER_WINDOW steps, so a rank missing from one step does not
    lower it (Prometheus would read a counter reset); both counters are exposed together
    (0 where no card counts them), so the alert can add them."""
    throttled = got.get("gpu.throttled", {}).get(step)
    if throttled is None and "gpu.sm_clock_ratio" not in got:
        return
    fam.gpu_throttled.add_metric(run, round(throttled.mean * throttled.n) if throttled else 0.0)
    names = ["gpu.xid_errors", "gpu.ecc_errors"]
    recent = rollups.read(
        conn, pk, names, step_from=step - OUTLIER_WINDOW + 1, step_to=step, live=live
    )
    for name, family in zip(names, (fam.gpu_xid, fam.gpu_ecc), strict=True):
        sums = [st.mean * st.n for st in recent.get(name, {}).values()]
        family.add_metric(run, float(round(max(sums))) if sums else 0.0)


class ReadModelCollector(Collector):
    """Exposes the live runs of a database (see the module docstring)."""

    def __init__(
        self, db: Database, *, grace_s: float, forget_after_s: float = float("inf"),
        top_k: int = 8, max_runs: int = MAX_RUNS,
    ) -> None:  # fmt: skip
        self.db = db
        self.grace_s = grace_s
        self.forget_after_s = forget_after_s
        self.top_k = top_k
        self.max_runs = max_runs

    def describe(self) -> list[Metric]:
        return []  # do not collect at registration

    def collect(self) -> Iterator[Metric]:
        fam = _Families()
        now = time.time()
        forget = min(self.forget_after_s, 1e12)
        with self.db.read() as conn:
            rows, left_out = runs.live_rows(conn, now=now, grace_s=self.grace_s,
                                            forget_after_s=forget, limit=self.max_runs)  # fmt: skip
            for row in rows:
                _collect_run(conn, fam, row, top_k=self.top_k, now=now)
        yield from fam.all()
        omitted = GaugeMetricFamily(
            M["runs_left_out"], "Live runs /metrics leaves out: beyond the newest "
            "`metrics_max_runs` by their last event.",
        )  # fmt: skip
        omitted.add_metric([], float(left_out))
        yield omitted


def exposition(
    db: Database, *, grace_s: float, forget_after_s: float = float("inf"), top_k: int = 8,
    max_runs: int = MAX_RUNS,
) -> bytes:  # fmt: skip
    """The Prometheus text exposition of the live runs."""
    registry = CollectorRegistry(auto_describe=False)
    collector = ReadModelCollector(
        db, grace_s=grace_s, forget_after_s=forget_after_s, top_k=top_k, max_runs=max_runs
    )
    registry.register(collector)
    return generate_latest(registry)


__all__ = ["OUTLIER_WINDOW", "STATS", "SUMMED", "ReadModelCollector", "exposition"]
