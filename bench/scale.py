"""Scale benchmark: one simulated stage-3 run of thousands of ranks against the server.

    .venv/bin/python bench/scale.py                                    # SQLite and PostgreSQL
    .venv/bin/python bench/scale.py --backends postgres --ranks 4096 --query-steps 1000
    .venv/bin/python bench/scale.py --skip-reads --ingest-repeats 3     # the median of 3 ingest runs

For each backend (SQLite; PostgreSQL started like the tests do) it prints:

1. **Ingest** through the real HTTP path with the agent's batching: every rank posts its own
   gzip batches (the agent's codec), each holding the steps one flush interval gathers
   (`AgentConfig().flush_interval(ranks)`, the agent's default, at one step every
   `--step-time-s`; at most `batch_max_events`): 16 steps a POST at 4,096 ranks and one
   step a second. Measured: rank-steps stored per second and the server's CPU time per
   rank-step (all its processes, from psutil), from the first POST until its compactor has
   rolled every step up (so the rollups' cost counts), with 1 worker, and with 2 workers
   (`zerowatch serve --workers 2`; on PostgreSQL: SQLite serves one process).
2. **/metrics** of that run once its rollups are compacted: series and bytes.
3. **Reads at scale**: a run of `--ranks` x `--fill-steps` rank-steps written straight
   through the store while the server runs, and rolled up by its compactor (timed: fill
   plus compaction, in rank-steps/s), then doubled in SQL (rows and rollups, shifted by the
   steps already stored: a copied step holds the same values as its original) until it
   holds `--query-steps` steps; then p50/p95 over HTTP of the series (rank statistics, one
   rank, the top 8 ranks), compare, the run resource and /metrics.
4. **Storage**: bytes per stored rank-step (database size / rank-steps, rollups included)
   and what a 4,096-rank x 100,000-step run takes with the default retention (every step
   of the newest 10,000, every 10th before; rollups whole).

The goals (issue 11): <= 100 us of server CPU per rank-step; /metrics <= 1,000 series and
200 KB; series / compare / run resource p95 <= 100 ms at 4,096 ranks x 1,000 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest as ib


@contextlib.contextmanager
def server(
    db_url: str, *, workers: int = 1, settings: dict[str, str] | None = None
) -> Iterator[str]:
    """A zerowatch server on a free port (`workers` uvicorn processes, more ZEROWATCH_*
    `settings` by environment name); yields its URL."""
    port = ib._free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    env.update(ZEROWATCH_DB_URL=db_url, ZEROWATCH_MAX_BATCH_BYTES=str(64 * 2**20))
    env.update(settings or {})
    log = tempfile.NamedTemporaryFile(prefix="zerowatch-scale-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "zerowatch.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--workers", str(workers)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(900):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(log.name).read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        ib.SERVER_PIDS[url] = proc.pid
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def _cpu_all(pid: int) -> float:
    import psutil

    p = psutil.Process(pid)
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = q.cpu_times()
            total += t.user + t.system
    return total


def wait_compacted(db_url: str, run_id: str, timeout_s: float = 3600) -> float:
    """Seconds until the server's compactor has rolled up every step of the run."""
    from sqlalchemy import func, select
    from zerowatch.server import models as m
    from zerowatch.server.db import Database

    db = Database.open(db_url, migrate_schema=False)
    t0 = time.perf_counter()
    try:
        with db.read() as conn:
            pk = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == run_id)).scalar()
        while time.perf_counter() - t0 < timeout_s:
            with db.read() as conn:
                left = conn.execute(select(func.count()).where(m.dirty_steps.c.run == pk)).scalar()
            if not left:
                return time.perf_counter() - t0
            time.sleep(0.5)
        raise TimeoutError(f"run {run_id} still has dirty steps after {timeout_s}s")
    finally:
        db.close()


def db_bytes(db_url: str) -> int:
    if db_url.startswith("sqlite"):
        path = Path(db_url.removeprefix("sqlite:///"))
        return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    from sqlalchemy import create_engine, text

    eng = create_engine(db_url)
    with eng.connect() as c:
        return int(c.execute(text("SELECT pg_database_size(current_database())")).scalar() or 0)


def agent_batch(ranks: int, step_time_s: float) -> tuple[float, int]:
    """(flush interval, events a POST) of the agent's default batching for `ranks` ranks
    stepping every `step_time_s`."""
    from zerowatch.agent.config import AgentConfig

    cfg = AgentConfig()
    interval = cfg.flush_interval(ranks)
    return interval, max(1, min(cfg.batch_max_events, int(interval / step_time_s)))


def ingest_row(url: str, db_url: str, args: argparse.Namespace, workers: int) -> dict[str, Any]:
    pid = ib.SERVER_PIDS[url]
    orig = ib.server_cpu_s
    ib.server_cpu_s = lambda _u: _cpu_all(pid)  # every worker process counts
    _, per_request = agent_batch(args.ranks, args.step_time_s)
    steps = args.ingest_steps or 2 * per_request
    try:
        out = ib.bench_ingest(url, ranks=args.ranks, steps=steps, per_request=per_request,
                              clients=args.clients, threads=args.threads,
                              settle=lambda run_id: wait_compacted(db_url, run_id))  # fmt: skip
    finally:
        ib.server_cpu_s = orig
    return {"workers": workers, **out}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median server CPU per rank-step (the lower middle of an even count),
    with every run's figure in `cpu_each`, in the order they ran: on a shared machine one
    run moves by about ±10%."""
    ranked = sorted(runs, key=lambda r: r["server_cpu_us_per_rank_step"])
    return {**ranked[(len(ranked) - 1) // 2],
            "cpu_each": [r["server_cpu_us_per_rank_step"] for r in runs]}  # fmt: skip


def double_until(db_url: str, run_id: str, steps: int, target: int) -> int:
    """Copy the run's rows and rollups forward (shifted by the steps stored) until it holds
    at least `target` steps; returns the steps it holds. Run totals and the per-rank
    counters follow."""
    from sqlalchemy import insert, literal, select, update
    from zerowatch.server import models as m
    from zerowatch.server.db import Database

    db = Database.open(db_url, migrate_schema=False)
    try:
        with db.write() as conn:
            pk = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == run_id)).scalar_one()
            factor = 1
            while steps < target:
                for table in (m.steps, m.collectives, m.step_rollups):
                    cols = list(table.c)
                    exprs = [c + literal(steps) if c.name in ("seq", "step")
                             else c + literal(float(steps)) if c.name == "time" else c
                             for c in cols]  # fmt: skip
                    conn.execute(insert(table).from_select(
                        [c.name for c in cols], select(*exprs).where(table.c.run == pk)
                    ))  # fmt: skip
                steps *= 2
                factor *= 2
            t = m.run_totals.c
            for key, value, buckets in conn.execute(
                select(t.key, t.value, t.buckets).where(t.run == pk)
            ).all():
                conn.execute(update(m.run_totals).where(t.run == pk, t.key == key).values(
                    value=value * factor, buckets=[int(n) * factor for n in buckets or []]
                ))  # fmt: skip
            conn.execute(update(m.rank_states).where(m.rank_states.c.run == pk).values(
                steps=steps, last_step=steps - 1
            ))  # fmt: skip
        return steps
    finally:
        db.close()


def metrics_of(url: str, run_id: str) -> tuple[int, int, float]:
    t = time.perf_counter()
    body = httpx.get(url + "/metrics", timeout=120).text
    ms = (time.perf_counter() - t) * 1e3
    lines = [ln for ln in body.splitlines() if ln and not ln.startswith("#") and run_id in ln]
    return len(lines), sum(len(ln) + 1 for ln in lines), ms


def read_rows(url: str, run_id: str, repeats: int) -> list[dict[str, Any]]:
    cases = [
        ("series step_time_s, rank stats", f"/api/v1/runs/{run_id}/series",
         {"metric": "step_time_s"}),
        ("series phase.backward, rank stats", f"/api/v1/runs/{run_id}/series",
         {"metric": "phase.backward"}),
        ("series collective.all_gather.busbw, stats", f"/api/v1/runs/{run_id}/series",
         {"metric": "collective.all_gather.busbw"}),
        ("series step_time_s, one rank", f"/api/v1/runs/{run_id}/series",
         {"metric": "step_time_s", "rank": 1234}),
        ("series busy_s, top 8 ranks", f"/api/v1/runs/{run_id}/series",
         {"metric": "busy_s", "top": 8}),
        ("compare (newest 100 steps)", "/api/v1/compare", {"runs": run_id}),
        ("run resource", f"/api/v1/runs/{run_id}", {}),
        ("/metrics", "/metrics", {}),
    ]  # fmt: skip
    out = []
    with httpx.Client(base_url=url, timeout=300) as c:
        for name, path, params in cases:
            r = c.get(path, params=params)
            r.raise_for_status()
            lat = []
            for _ in range(repeats):
                t = time.perf_counter()
                r = c.get(path, params=params)
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
            out.append({"query": name, "p50_ms": ib.pct(lat, 0.5) * 1e3,
                        "p95_ms": ib.pct(lat, 0.95) * 1e3, "bytes": len(r.content)})  # fmt: skip
    return out


def run_backend(name: str, args: argparse.Namespace) -> None:
    with ib.backend(name) as db_url:
        if db_url is None:
            print(f"\n## {name}: skipped (no PostgreSQL binaries)")
            return
        interval, per_request = agent_batch(args.ranks, args.step_time_s)
        print(f"\n## {name} ({args.ranks} ranks, load {os.getloadavg()[0]:.1f}; the agent's "
              f"batching: a flush every {interval:g} s, {per_request} steps a POST at a step "
              f"every {args.step_time_s:g} s)")  # fmt: skip
        worker_counts = [int(w) for w in args.workers.split(",")] if name == "postgres" else [1]
        ingest_rows = []
        for workers in worker_counts:
            # Each repeat on a fresh server: a run of its own, the same requests.
            runs = []
            for _ in range(args.ingest_repeats):
                with server(db_url, workers=workers) as url:
                    runs.append(ingest_row(url, db_url, args, workers))
            ingest_rows.append(median_run(runs))
        print("\n| workers | events/POST | rank-steps | rank-steps/s | server CPU µs / rank-step "
              "| POST p50 | POST p99 |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in ingest_rows:
            each = r["cpu_each"]
            spread = f" (runs: {', '.join(f'{c:.0f}' for c in each)})" if len(each) > 1 else ""
            print(f"| {r['workers']} | {r['events_per_request']} | {r['rank_steps']:,} | "
                  f"{r['rank_steps_per_s']:,.0f} | {r['server_cpu_us_per_rank_step']:.0f}"
                  f"{spread} | {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms |")  # fmt: skip
        if args.skip_reads:
            return
        with server(db_url, workers=1) as url:
            t = time.perf_counter()
            fill = min(args.fill_steps, args.query_steps)
            run_id = ib.fill(db_url, ranks=args.ranks, points=args.ranks * fill)
            filled = time.perf_counter() - t
            compact_s = wait_compacted(db_url, run_id)
            print(f"\nfilled {args.ranks * fill:,} rank-steps through the store in {filled:.0f} "
                  f"s; the compactor finished {compact_s:.0f} s later "
                  f"(~{args.ranks * fill / max(filled + compact_s, 1e-9):,.0f} rank-steps/s "
                  "with fill)")  # fmt: skip
            t = time.perf_counter()
            held = double_until(db_url, run_id, fill, args.query_steps)
            rank_steps = args.ranks * held
            if held > fill:
                print(f"doubled in SQL to {held:,} steps ({rank_steps:,} rank-steps) in "
                      f"{time.perf_counter() - t:.0f} s")  # fmt: skip
            n_series, n_bytes, ms = metrics_of(url, run_id)
            print(f"\n/metrics for the {args.ranks}-rank run: {n_series} series, "
                  f"{n_bytes / 1024:.1f} KiB (scrape {ms:.0f} ms)")  # fmt: skip
            rows = read_rows(url, run_id, args.repeats)
            print(f"\n| read at {args.ranks} ranks x {held} steps | p50 | p95 | bytes |")
            print("|---|---:|---:|---:|")
            for r in rows:
                print(f"| {r['query']} | {r['p50_ms']:.1f} ms | {r['p95_ms']:.1f} ms | "
                      f"{r['bytes']:,} |")  # fmt: skip
        size = db_bytes(db_url)
        per = size / (rank_steps + sum(r["rank_steps"] for r in ingest_rows))
        kept = 10_000 + 90_000 // 10
        total = 4096 * kept * per
        print(f"\nstorage: {size / 2**20:.0f} MiB for the database, {per:.0f} B per stored "
              f"rank-step (rollups included); a 4,096-rank x 100,000-step run keeps "
              f"{kept:,} steps of per-rank rows with the default retention: "
              f"~{total / 2**30:.0f} GiB (without retention ~{4096 * 100_000 * per / 2**30:.0f} GiB)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument(
        "--ingest-steps",
        type=int,
        default=0,
        help="steps each rank posts (0: two of the agent's POSTs)",
    )
    ap.add_argument(
        "--step-time-s", type=float, default=1.0, help="how often a rank steps (the batching)"
    )
    ap.add_argument(
        "--skip-reads", action="store_true", help="ingest only (no fill, reads or storage)"
    )
    ap.add_argument("--workers", default="1,2",
                    help="server processes to measure ingest with, on PostgreSQL (SQLite: 1)")  # fmt: skip
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--query-steps", type=int, default=1000)
    ap.add_argument(
        "--fill-steps",
        type=int,
        default=125,
        help="steps written through the store; doubled in SQL up to --query-steps",
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--ingest-repeats", type=int, default=1,
                    help="ingest runs per worker count, each on a fresh server: the table "
                         "shows the median run and every run's CPU figure")  # fmt: skip
    args = ap.parse_args()
    for name in args.backends.split(","):
        run_backend(name.strip(), args)


if __name__ == "__main__":
    main()
