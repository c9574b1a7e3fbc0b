"""`/metrics`: a prometheus-client Collector over the live cache.

Nothing is registered per run: each scrape builds metric families from a snapshot of
`LiveCache`, so a run that ends and passes its grace period simply stops appearing (no
stale series to unregister). Names come from `events.METRICS` (the alert rules use the
same dict); docs/metrics.md lists every metric with its unit and how it is measured.

Labels: `run` (run_id) and `project` on everything; `rank` where the value is per rank;
`phase`, `op`, `direction`, `kind` where the metric has those dimensions.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from zerowatch.server.live import LiveCache, RunLive

from zerowatch import events as ev

M = ev.METRICS
BUCKET_BOUNDS = [*(repr(float(b)) for b in ev.LATENCY_BUCKETS), "+Inf"]

RUN = ["run", "project"]
RANK = ["run", "project", "rank"]

#: (key in events.METRICS, documentation, label names) for the plain per-rank gauges.
RANK_GAUGES = {
    "step_time": "Wall-clock time of the newest optimizer step.",
    "optimizer_step": "Time of the optimizer step phase in the newest step (CPU Adam when offloaded).",
    "exposed_comm": "Communication time compute did not hide in the newest step.",
    "grad_norm": "Global gradient norm before clipping in the newest step.",
    "loss": "Training loss reported for the newest step.",
    "loss_scale": "Dynamic loss scale (fp16) in the newest step.",
    "samples_per_second": "Samples per second of this rank in the newest step.",
    "tokens_per_second": "Tokens per second of this rank in the newest step.",
    "memory_capacity": "Memory capacity of the rank's device.",
}


class LiveRunsCollector(Collector):
    """Exposes the live runs of a LiveCache."""

    def __init__(
        self, live: LiveCache, *, grace_s: float, forget_after_s: float = float("inf")
    ) -> None:
        self.live = live
        self.grace_s = grace_s
        self.forget_after_s = forget_after_s

    def describe(self) -> list[Metric]:
        # Do not call collect() at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        runs = self.live.snapshot(grace_s=self.grace_s, forget_after_s=self.forget_after_s)
        yield from _run_families(runs)
        yield from _rank_families(runs)


def _run_families(runs: list[RunLive]) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        M["run_info"],
        "Run description; value 1.",
        labels=[
            *RUN,
            "name",
            "stage",
            "precision",
            "offload_optimizer",
            "offload_param",
            "engine",
            "world_size",
        ],
    )
    running = GaugeMetricFamily(
        M["run_running"], "1 while the run has not ended (also when stalled), else 0.", labels=RUN
    )
    last = GaugeMetricFamily(M["last_event"], "Unix time of the run's newest event.", labels=RUN)
    for r in runs:
        i = r.info
        info.add_metric(
            [
                r.run_id,
                r.project,
                i["name"],
                i["stage"],
                i["precision"],
                i["offload_optimizer"],
                i["offload_param"],
                i["engine"],
                i["world_size"],
            ],
            1.0,
        )
        running.add_metric([r.run_id, r.project], 1.0 if r.status == "running" else 0.0)
        if r.last_event_at is not None:
            last.add_metric([r.run_id, r.project], r.last_event_at)
    yield info
    yield running
    yield last


def _rank_families(runs: list[RunLive]) -> Iterator[Metric]:
    gauges = {k: GaugeMetricFamily(M[k], doc, labels=RANK) for k, doc in RANK_GAUGES.items()}
    steps = CounterMetricFamily(
        M["steps"], "Steps stored for this rank since the server started.", labels=RANK
    )
    skipped = CounterMetricFamily(
        M["skipped_steps"], "Optimizer steps skipped (fp16 overflow).", labels=RANK
    )
    nonfinite = CounterMetricFamily(
        M["nonfinite"], "Steps with a non-finite loss or gradient.", labels=RANK
    )
    phase = GaugeMetricFamily(
        M["phase"], "Time of each phase in the newest step.", labels=[*RANK, "phase"]
    )
    latency = HistogramMetricFamily(
        M["collective_latency"],
        "Latency of collective calls, cumulative over the run.",
        labels=[*RANK, "op"],
    )
    busbw = GaugeMetricFamily(
        M["collective_busbw"],
        "Bus bandwidth (nccl-tests) of each op in the newest step.",
        labels=[*RANK, "op"],
    )
    cbytes = GaugeMetricFamily(
        M["collective_bytes"],
        "Bytes (nccl-tests size) of each op in the newest step.",
        labels=[*RANK, "op"],
    )
    offload = GaugeMetricFamily(
        M["offload_bw"],
        "Host-device copy bandwidth in the newest step.",
        labels=[*RANK, "direction"],
    )
    peak = GaugeMetricFamily(
        M["memory_peak"], "Peak memory of each phase in the newest step.", labels=[*RANK, "phase"]
    )
    state = GaugeMetricFamily(
        M["model_state"], "Model-state bytes the engine holds, by kind.", labels=[*RANK, "kind"]
    )
    theory = GaugeMetricFamily(
        M["model_state_theory"],
        "Model-state bytes the ZeRO model predicts, by kind.",
        labels=[*RANK, "kind"],
    )
    for r in runs:
        for rank, rl in sorted(r.ranks.items()):
            lv = [r.run_id, r.project, str(rank)]
            steps.add_metric(lv, rl.steps_total)
            skipped.add_metric(lv, rl.skipped_total)
            nonfinite.add_metric(lv, rl.nonfinite_total)
            for op, t in sorted(rl.ops.items()):
                cum, acc = [], 0
                for bound, n in zip(BUCKET_BOUNDS, t.buckets, strict=True):
                    acc += n
                    cum.append((bound, acc))
                latency.add_metric([*lv, op], cum, t.latency_sum_s)
                busbw.add_metric([*lv, op], t.last_busbw)
                cbytes.add_metric([*lv, op], t.last_bytes)
            e = rl.latest
            if e is None:
                continue
            values = {
                "step_time": e.step_time_s,
                "optimizer_step": e.phases.get("optimizer_step"),
                "exposed_comm": e.exposed_comm_s,
                "grad_norm": e.grad_norm,
                "loss": e.loss,
                "loss_scale": e.loss_scale,
                "samples_per_second": e.samples_per_s,
                "tokens_per_second": e.tokens_per_s,
                "memory_capacity": (e.memory.capacity_bytes or None) if e.memory else None,
            }
            for k, v in values.items():
                if v is not None:
                    gauges[k].add_metric(lv, float(v))
            for name, seconds in sorted(e.phases.items()):
                phase.add_metric([*lv, name], seconds)
            for o in e.offload:
                bw = o.bandwidth_bytes_per_s or (o.bytes / o.seconds if o.seconds > 0 else 0.0)
                offload.add_metric([*lv, o.direction], bw)
            if e.memory is not None:
                for name, b in sorted(e.memory.peak_by_phase.items()):
                    peak.add_metric([*lv, name], b)
                for kind, b in sorted(e.memory.model_state.items()):
                    state.add_metric([*lv, kind], b)
                for kind, b in sorted(e.memory.model_state_theory.items()):
                    theory.add_metric([*lv, kind], b)
    yield from gauges.values()
    yield from (
        steps,
        skipped,
        nonfinite,
        phase,
        latency,
        busbw,
        cbytes,
        offload,
        peak,
        state,
        theory,
    )


def exposition(live: LiveCache, *, grace_s: float, forget_after_s: float = float("inf")) -> bytes:
    """The Prometheus text exposition of the live runs."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveRunsCollector(live, grace_s=grace_s, forget_after_s=forget_after_s))
    return generate_latest(registry)


__all__ = ["LiveRunsCollector", "exposition"]
