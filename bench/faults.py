"""Faults at scale: a recovery storm after an outage, and a long soak of one server.

    .venv/bin/python bench/faults.py                           # storms of 1,024 and 4,096 ranks
    .venv/bin/python bench/faults.py --ranks 1024 --outage-s 300 --backend postgres
    .venv/bin/python bench/faults.py --soak --minutes 30       # 256 ranks, one step a second

**Recovery storm.** A job's server was away for `--outage-s` seconds (300) while its ranks
trained at one step a second: every rank's spool holds that many steps, written through the
agent's own Spool (tests/support/sim_agents.py; the events are zerowatch.simulate's). Then
the server is back and every rank's shipper (the agent's real Transport, spool and HTTP
client; `--procs` processes of many ranks each, no torch) replays at once (with
`--live-step-s S` training goes on meanwhile, a step every S seconds per rank; off by
default: whether a server keeps up with a job at all, 4,096 rank-steps a second for 4,096
ranks at 1 s, is its sustained ingest rate, which bench/ingest.py and bench/scale.py
measure). Measured: the time until every rank's spool is empty (the
outage drained), rank-steps stored per second meanwhile, how many requests the server shed
(503 + Retry-After) and whether any agent came back before its Retry-After, the server's
peak resident memory (VmHWM) against its memory before the storm, and the latency of the
run page and of a /metrics scrape during the storm against the same reads once it is
over (the baseline, same data). At the end every rank's steps are counted in the database:
each (rank, seq) of the outage and of the live steps exactly once.

`--unbounded` runs the same storm a second time with admission off (`ingest_max_pending`
1,000,000), for the memory and latency it buys.

**Soak** (`--soak`): one server ingesting a `--soak-ranks` (256) rank run at one step a
second per rank (`--step-s`) for `--minutes`; every `--sample-s` (30) the server's resident
memory and open file descriptors, and the p95 of the agents' ingest POSTs, of a series read
and of /metrics in that window. Printed: that table, the memory slope after the first
`--warmup` (a fifth) of the run by least squares (MB per hour), and the fd count's range.

The machine matters: note its cores and load beside the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.live_server import LiveServer  # noqa: E402
from support.sim_agents import (  # noqa: E402
    RecordingClient,
    SimAgents,
    prefill_spools,
    run_create_json,
)

from zerowatch import simulate  # noqa: E402

MB = 2**20


# -- the server's process --------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (bytes) and open fds of a process, from /proc."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


class Prober(threading.Thread):
    """Times GETs of `paths` one after another, every `every_s`, until stopped."""

    def __init__(self, base: str, paths: dict[str, str], every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.base, self.paths, self.every_s = base, paths, every_s
        self.times: dict[str, list[tuple[float, float, int]]] = {k: [] for k in paths}
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self.stop.is_set():
                for name, path in self.paths.items():
                    t0 = time.monotonic()
                    try:
                        code = c.get(path).status_code
                    except httpx.HTTPError:
                        code = 0
                    self.times[name].append((t0, time.monotonic() - t0, code))
                self.stop.wait(self.every_s)

    def window(self, name: str, t0: float, t1: float) -> list[float]:
        return [d for t, d, code in self.times[name] if t0 <= t < t1 and code == 200]


# -- simulated agents, in worker processes ----------------------------------------------------


def _agents_worker(
    conn: Any, server: str, spec_kw: dict[str, Any], run_id: str, ranks: list[int],
    spool_root: str, outage_steps: int, step_s: float, go: Any, stop: Any,
    token: str | None = None,
) -> None:  # fmt: skip
    spec = simulate.SimSpec(**spec_kw)
    written = prefill_spools(Path(spool_root), spec, run_id, ranks=ranks, steps=outage_steps)
    conn.send(("ready", written))
    clients: list[RecordingClient] = []

    def factory(*a: Any, **kw: Any) -> RecordingClient:
        clients.append(RecordingClient(*a, token=token, **kw))
        return clients[-1]

    agents = SimAgents(server, spec, run_id, ranks=ranks, spool_root=Path(spool_root),
                       next_step=outage_steps, client_factory=factory)  # fmt: skip
    go.wait()
    started = time.time()
    agents.start()
    next_tick, drained_at = time.monotonic() + step_s, None
    while not stop.is_set():
        if step_s > 0 and time.monotonic() >= next_tick:
            agents.step()
            next_tick += step_s
        if (
            outage_steps
            and drained_at is None
            and not any(t.spool.pending for t in agents.transports)
        ):
            drained_at = time.time()
            conn.send(("drained", drained_at - started))
        stop.wait(0.25)
    agents.close(60)
    statuses: Counter[int] = Counter()
    early, waits, posts = 0, 0, []
    for c in clients:
        for i, (t0, t1, code, retry_after) in enumerate(c.posts):
            statuses[code] += 1
            posts.append((t0, t1 - t0, code))
            if retry_after is not None and i + 1 < len(c.posts):
                waits += 1
                early += c.posts[i + 1][0] < t1 + retry_after - 0.01
    conn.send(("done", {
        "next_step": agents.next_step, "accepted": agents.stats().accepted,
        "duplicates": agents.stats().duplicates, "dropped": agents.dropped,
        "statuses": dict(statuses), "retries_after_wait": waits, "early": early,
        "posts": posts, "pending": agents.pending(),
    }))  # fmt: skip


class Workers:
    """`procs` processes of simulated ranks (ranks dealt round-robin)."""

    def __init__(self, server: str, spec: simulate.SimSpec, run_id: str, spool_root: Path,
                 *, procs: int, outage_steps: int, step_s: float,
                 token: str | None = None) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self.go, self.stop = ctx.Event(), ctx.Event()
        self.conns, self.procs = [], []
        spec_kw = {"world_size": spec.world_size, "spans_every": spec.spans_every}
        for i in range(procs):
            parent, child = ctx.Pipe()
            ranks = list(range(i, spec.world_size, procs))
            p = ctx.Process(target=_agents_worker, args=(child, server, spec_kw, run_id, ranks,
                            str(spool_root), outage_steps, step_s, self.go, self.stop,
                                                          token))  # fmt: skip
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def expect(self, kind: str, timeout_s: float = 3600) -> list[Any]:
        out = []
        for c in self.conns:
            if not c.poll(timeout_s):
                raise TimeoutError(f"no {kind!r} from a worker in {timeout_s} s")
            got, value = c.recv()
            assert got == kind, (got, kind)
            out.append(value)
        return out

    def finish(self) -> list[dict[str, Any]]:
        self.stop.set()
        done = self.expect("done")
        for p in self.procs:
            p.join(120)
        return done


def stored_summary(db_url: str, run_id: str) -> dict[int, tuple[int, int, int, int]]:
    """Per rank: rows, min seq, max seq, and the server's own step counter."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            pk = c.execute(text("SELECT id FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
            rows = c.execute(text("SELECT rank, count(*), min(seq), max(seq) FROM steps "
                                  "WHERE run = :p GROUP BY rank"), {"p": pk})  # fmt: skip
            out = {r: (n, lo, hi, 0) for r, n, lo, hi in rows}
            for r, n in c.execute(text("SELECT rank, steps FROM rank_states WHERE run = :p"),
                                  {"p": pk}):  # fmt: skip
                out[r] = (*out.get(r, (0, -1, -1))[:3], n)
    finally:
        engine.dispose()
    return out


# -- the storm -----------------------------------------------------------------------------------


def storm(args: argparse.Namespace, ranks: int, tmp: Path, *, unbounded: bool) -> dict[str, Any]:
    spec = simulate.SimSpec(world_size=ranks, spans_every=10)
    run_id = f"storm-{ranks}-{uuid.uuid4().hex[:8]}"
    outage_steps = int(args.outage_s / args.step_s)
    settings: dict[str, Any] = {"max_batch_bytes": 64 * MB}
    if unbounded:
        settings["ingest_max_pending"] = 1_000_000
    db_url = None
    pg_ctx: Any = contextlib.nullcontext()
    if args.backend == "postgres":
        from support.postgres import postgres

        pg_ctx = postgres()
    with pg_ctx as pg:
        if pg is not None:
            db_url = pg.create_database("storm")
        with LiveServer(db_url=db_url, settings=settings) as server:
            r = httpx.post(f"{server.api}/runs", content=run_create_json(spec, run_id),
                           headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
            r.raise_for_status()
            assert server.pid is not None
            t_fill = time.monotonic()
            workers = Workers(server.url, spec, run_id, tmp / f"spool-{run_id}",
                              procs=args.procs, outage_steps=outage_steps,
                              step_s=args.live_step_s)  # fmt: skip
            outage_events = sum(workers.expect("ready"))
            fill_s = time.monotonic() - t_fill
            for path in (f"/runs/{run_id}", "/metrics"):  # first renders import and warm up
                httpx.get(server.url + path, timeout=60).raise_for_status()
            before = proc_status(server.pid)
            prober = Prober(server.url, {"run page": f"/runs/{run_id}", "scrape": "/metrics"},
                            every_s=args.probe_every_s)  # fmt: skip
            rss: list[int] = []
            sampling = threading.Event()

            def sample() -> None:
                while not sampling.wait(0.5):
                    with contextlib.suppress(OSError):
                        rss.append(proc_status(server.pid)["VmRSS"])  # type: ignore[arg-type]

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.monotonic()
            if args.probe_every_s > 0:
                prober.start()
            workers.go.set()
            drained = max(workers.expect("drained"))
            t_drained = time.monotonic()
            time.sleep(max(2 * args.live_step_s, 3.0))  # the live steps after the drain land
            done = workers.finish()
            time.sleep(3.0)  # reads once the storm is over: the baseline
            t_idle = time.monotonic()
            time.sleep(max(10.0, 10 * prober.every_s) if args.probe_every_s > 0 else 0)
            prober.stop.set()
            if prober.is_alive():
                prober.join()
            sampling.set()
            sampler.join()
            peak = proc_status(server.pid)
            summary = stored_summary(server.db_url, run_id)
    statuses: Counter[int] = Counter()
    for d in done:
        statuses.update(d["statuses"])
    bad = []
    for d_i, d in enumerate(done):
        for r in range(d_i, ranks, args.procs):
            n = d["next_step"]
            got = summary.get(r)
            if got != (n, 0, n - 1, n):
                bad.append((r, got, n))
    live = sum((d["next_step"] - outage_steps) * len(range(i, ranks, args.procs))
               for i, d in enumerate(done))  # fmt: skip
    storm_window = (t0, t_drained)
    return {
        "ranks": ranks, "backend": args.backend, "unbounded": unbounded,
        "outage_events": outage_events, "live_events": live, "fill_s": fill_s,
        "drain_s": drained, "rate": outage_events / drained,
        "statuses": dict(statuses),
        "retries_after_wait": sum(d["retries_after_wait"] for d in done),
        "early": sum(d["early"] for d in done),
        "accepted": sum(d["accepted"] for d in done),
        "duplicates": sum(d["duplicates"] for d in done),
        "dropped": sum(d["dropped"] for d in done),
        "exact": not bad, "bad": bad[:5],
        "rss_before": before["VmRSS"], "rss_peak": peak["VmHWM"],
        "rss_max_sampled": max(rss, default=0),
        "page": prober.window("run page", *storm_window),
        "scrape": prober.window("scrape", *storm_window),
        "page_idle": prober.window("run page", t_idle, float("inf")),
        "scrape_idle": prober.window("scrape", t_idle, float("inf")),
    }  # fmt: skip


def print_storms(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nRecovery storm after a {args.outage_s:.0f} s outage ({args.backend}, "
          f"{args.procs} agent processes, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f})\n")  # fmt: skip
    print(
        "| ranks | admission | outage rank-steps | drain s | rank-steps/s | shed (503) "
        "| early retries | RSS before | RSS peak | peak / before | exactly once |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['ranks']:,} | {'off' if r['unbounded'] else 'on'} | "
              f"{r['outage_events']:,} | {r['drain_s']:.1f} | {r['rate']:,.0f} | "
              f"{r['statuses'].get(503, 0):,} | {r['early']} of {r['retries_after_wait']:,} | "
              f"{r['rss_before'] / MB:.0f} MB | {r['rss_peak'] / MB:.0f} MB | "
              f"{r['rss_peak'] / r['rss_before']:.2f} | "
              f"{'yes' if r['exact'] else 'NO ' + str(r['bad'])} |")  # fmt: skip
    print(
        "\n| ranks | admission | read | n (storm) | p50 storm | p95 storm | max storm "
        "| p95 after | p95 storm / after |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for name, key in (("run page", "page"), ("/metrics", "scrape")):
            s, idle = r[key], r[key + "_idle"]
            print(f"| {r['ranks']:,} | {'off' if r['unbounded'] else 'on'} | {name} | "
                  f"{len(s)} | {pct(s, 0.5):.2f} s | {pct(s, 0.95):.2f} s | "
                  f"{max(s, default=float('nan')):.2f} s | {pct(idle, 0.95):.2f} s | "
                  f"{pct(s, 0.95) / pct(idle, 0.95):.1f} |")  # fmt: skip
    for r in rows:
        print(f"\n{r['ranks']:,} ranks, admission {'off' if r['unbounded'] else 'on'}: "
              f"answers {r['statuses']}; stored {r['accepted']:,} (outage {r['outage_events']:,}"
              f" + live {r['live_events']:,}), duplicates answered {r['duplicates']:,}, "
              f"dropped {r['dropped']}; spool prefill {r['fill_s']:.0f} s")  # fmt: skip


# -- the soak ------------------------------------------------------------------------------------


def soak(args: argparse.Namespace, tmp: Path) -> None:
    ranks = args.soak_ranks
    spec = simulate.SimSpec(world_size=ranks, spans_every=10)
    run_id = f"soak-{ranks}-{uuid.uuid4().hex[:8]}"
    with LiveServer() as server:
        r = httpx.post(f"{server.api}/runs", content=run_create_json(spec, run_id),
                       headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
        r.raise_for_status()
        assert server.pid is not None
        workers = Workers(server.url, spec, run_id, tmp / "spool-soak", procs=1,
                          outage_steps=0, step_s=args.step_s)  # fmt: skip
        workers.expect("ready")
        prober = Prober(server.url, {
            "series": f"/api/v1/runs/{run_id}/series?metric=step_time_s",
            "metrics": "/metrics",
        }, every_s=2.0)  # fmt: skip
        samples: list[tuple[float, dict[str, int]]] = []
        t0 = time.monotonic()
        workers.go.set()
        prober.start()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(args.sample_s, max(end - time.monotonic(), 0)))
            samples.append((time.monotonic() - t0, proc_status(server.pid)))
        prober.stop.set()
        prober.join()
        done = workers.finish()
        summary = stored_summary(server.db_url, run_id)
    posts = [p for d in done for p in d["posts"]]
    n = done[0]["next_step"]
    exact = all(summary.get(r) == (n, 0, n - 1, n) for r in range(ranks))
    print(f"\nSoak: {ranks} ranks, a step every {args.step_s} s, {args.minutes} min "
          f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}); stored "
          f"{sum(v[0] for v in summary.values()):,} rank-steps, every step exactly once: "
          f"{'yes' if exact else 'NO'}\n")  # fmt: skip
    print("| minute | RSS MB | fds | ingest POST p95 | series p95 | /metrics p95 |")
    print("|---:|---:|---:|---:|---:|---:|")
    prev = 0.0
    for t, st in samples:
        w0, w1 = t0 + prev, t0 + t
        ing = [d for (s, d, code) in posts if w0 <= s < w1 and code == 200]
        print(f"| {t / 60:.1f} | {st['VmRSS'] / MB:.0f} | {st['fds']} | "
              f"{pct(ing, 0.95) * 1000:.0f} ms | {pct(prober.window('series', w0, w1), 0.95) * 1000:.0f} ms | "
              f"{pct(prober.window('metrics', w0, w1), 0.95) * 1000:.0f} ms |")  # fmt: skip
        prev = t
    warm = [(t, st["VmRSS"] / MB) for t, st in samples if t >= args.warmup * args.minutes * 60]
    if len(warm) >= 2:
        slope = statistics.linear_regression([t for t, _ in warm], [m for _, m in warm]).slope
        print(f"\nRSS slope after warm-up ({args.warmup:.0%} of the run): "
              f"{slope * 3600:+.1f} MB/hour over {len(warm)} samples "
              f"({warm[0][1]:.0f} -> {warm[-1][1]:.0f} MB)")  # fmt: skip
    fds = [st["fds"] for _, st in samples]
    print(f"open fds: {min(fds)}..{max(fds)} (first {fds[0]}, last {fds[-1]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--outage-s", type=float, default=300.0)
    ap.add_argument("--step-s", type=float, default=1.0,
                    help="the job's step time: the outage leaves outage-s / step-s steps per "
                    "rank; the soak's ranks step this often")  # fmt: skip
    ap.add_argument("--live-step-s", type=float, default=0.0,
                    help="during the storm the ranks keep training, a step this often (0: "
                    "not: the server's sustained rate, not the storm, would then decide)")  # fmt: skip
    ap.add_argument("--procs", type=int, default=2, help="agent processes")
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--probe-every-s", type=float, default=2.0,
                    help="time a run page and a /metrics scrape this often (0: never)")  # fmt: skip
    ap.add_argument("--unbounded", action="store_true",
                    help="run each storm again with admission off")  # fmt: skip
    ap.add_argument("--soak", action="store_true")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--soak-ranks", type=int, default=256)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=0.2)
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zerowatch-faults-") as d:
        if args.soak:
            soak(args, Path(d))
            return
        rows = []
        for ranks in args.ranks:
            rows.append(storm(args, ranks, Path(d), unbounded=False))
            if args.unbounded:
                rows.append(storm(args, ranks, Path(d), unbounded=True))
        print_storms(rows, args)


if __name__ == "__main__":
    main()
