"""The live cache: what /metrics reports, kept in memory and updated on ingest.

A Prometheus scrape must not scan the steps table, so every stored step event also updates
this cache: per run, per rank, the newest step's values, plus running totals (the latency
histogram of each collective op, cumulative over the run, and counters of steps, skipped
and non-finite steps). Totals restart from zero when the server restarts, which Prometheus
reads as a counter reset (rate() and increase() handle it).

Finished and failed runs stay for `finished_grace_s` after they end, then drop out, so the
exposition's cardinality follows the runs that are live.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from zerowatch import events as ev

N_BUCKETS = len(ev.LATENCY_BUCKETS) + 1


@dataclass
class OpTotals:
    """One collective op on one rank: the run's histogram and the newest step's figures."""

    #: Non-cumulative bucket counts over the run (+Inf last).
    buckets: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    latency_sum_s: float = 0.0
    count: int = 0
    #: The newest step: bytes of this op and its bus bandwidth.
    last_bytes: int = 0
    last_busbw: float = 0.0


@dataclass
class RankLive:
    """One rank's newest step and running totals."""

    last_step: int = -1
    last_time: float = 0.0
    steps_total: int = 0
    skipped_total: int = 0
    nonfinite_total: int = 0
    #: The newest step's event (by step number).
    latest: ev.StepEvent | None = None
    ops: dict[str, OpTotals] = field(default_factory=dict)


@dataclass
class RunLive:
    """One run as /metrics sees it."""

    run_id: str
    project: str
    name: str
    info: dict[str, str]
    status: str = "running"
    last_event_at: float | None = None
    ended_at: float | None = None
    ranks: dict[int, RankLive] = field(default_factory=dict)


class LiveCache:
    """Thread-safe map run_id -> RunLive (ingest threads write, scrapes read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, RunLive] = {}

    def register(self, run: dict[str, Any]) -> None:
        """Add (or refresh the metadata of) a run from its stored row (a queries run dict)."""
        info = {
            "name": str(run["name"]),
            "stage": str(run["zero_stage"]),
            "precision": str(run["precision"]),
            "offload_optimizer": str(run["offload_optimizer"]),
            "offload_param": str(run["offload_param"]),
            "engine": str(run["engine"]),
            "world_size": str(run["world_size"]),
        }
        with self._lock:
            live = self._runs.get(run["run_id"])
            if live is None:
                live = RunLive(
                    run_id=run["run_id"], project=run["project"], name=run["name"], info=info
                )
                self._runs[run["run_id"]] = live
            live.info = info
            stored = run.get("stored_status", run.get("status", "running"))
            live.status = "running" if stored == "stalled" else stored
            live.last_event_at = run.get("last_event_at") or live.last_event_at
            live.ended_at = run.get("ended_at")

    def known(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._runs

    def apply(
        self,
        run_id: str,
        steps: list[ev.StepEvent],
        *,
        status: str,
        last_event_at: float | None,
        ended_at: float | None = None,
    ) -> None:
        """Fold newly stored step events into the run's figures."""
        with self._lock:
            live = self._runs.get(run_id)
            if live is None:
                return
            for e in steps:
                r = live.ranks.get(e.rank)
                if r is None:
                    r = live.ranks[e.rank] = RankLive()
                r.steps_total += 1
                r.skipped_total += int(e.skipped)
                r.nonfinite_total += int(e.nonfinite)
                newest = e.step >= r.last_step
                if newest:
                    r.last_step, r.last_time, r.latest = e.step, e.time, e
                step_bytes: dict[str, int] = {}
                step_lat: dict[str, float] = {}
                step_busbw_bytes: dict[str, float] = {}
                for c in e.collectives:
                    t = r.ops.get(c.op)
                    if t is None:
                        t = r.ops[c.op] = OpTotals()
                    for i, n in enumerate(c.buckets[:N_BUCKETS]):
                        t.buckets[i] += n
                    t.latency_sum_s += c.latency_sum_s
                    t.count += c.count
                    step_bytes[c.op] = step_bytes.get(c.op, 0) + c.bytes
                    step_lat[c.op] = step_lat.get(c.op, 0.0) + c.latency_sum_s
                    factor = ev.bus_bandwidth_factor(c.op, c.world_size)
                    step_busbw_bytes[c.op] = step_busbw_bytes.get(c.op, 0.0) + c.bytes * factor
                if newest:
                    for op, t in r.ops.items():
                        t.last_bytes = step_bytes.get(op, 0)
                        lat = step_lat.get(op, 0.0)
                        t.last_busbw = step_busbw_bytes.get(op, 0.0) / lat if lat > 0 else 0.0
            live.status = status
            if last_event_at is not None:
                live.last_event_at = max(live.last_event_at or 0.0, last_event_at)
            if ended_at is not None:
                live.ended_at = ended_at

    def end(self, run_id: str, *, status: str, ended_at: float) -> None:
        with self._lock:
            live = self._runs.get(run_id)
            if live is not None:
                live.status, live.ended_at = status, ended_at

    def drop(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def snapshot(
        self, *, grace_s: float, forget_after_s: float = float("inf"), now: float | None = None
    ) -> list[RunLive]:
        """The runs to expose now. Evicted first: ended runs past their grace period, and
        runs silent for `forget_after_s` (killed without an end event)."""
        now = time.time() if now is None else now
        with self._lock:
            gone = [
                rid
                for rid, r in self._runs.items()
                if (
                    r.status in ("finished", "failed")
                    and now - (r.ended_at or r.last_event_at or now) > grace_s
                )
                or (r.last_event_at is not None and now - r.last_event_at > forget_after_s)
            ]
            for rid in gone:
                del self._runs[rid]
            # Shallow copies of the per-rank state: the collector reads outside the lock.
            out = []
            for r in self._runs.values():
                ranks = {
                    k: RankLive(
                        last_step=v.last_step,
                        last_time=v.last_time,
                        steps_total=v.steps_total,
                        skipped_total=v.skipped_total,
                        nonfinite_total=v.nonfinite_total,
                        latest=v.latest,
                        ops={
                            op: OpTotals(
                                list(t.buckets),
                                t.latency_sum_s,
                                t.count,
                                t.last_bytes,
                                t.last_busbw,
                            )
                            for op, t in v.ops.items()
                        },
                    )
                    for k, v in r.ranks.items()
                }
                out.append(
                    RunLive(
                        run_id=r.run_id,
                        project=r.project,
                        name=r.name,
                        info=dict(r.info),
                        status=r.status,
                        last_event_at=r.last_event_at,
                        ended_at=r.ended_at,
                        ranks=ranks,
                    )
                )
            return out


__all__ = ["LiveCache", "OpTotals", "RankLive", "RunLive"]
