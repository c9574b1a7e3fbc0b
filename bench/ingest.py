"""Ingest and query benchmark of one zerowatch server process.

    .venv/bin/python bench/ingest.py                        # SQLite and PostgreSQL
    .venv/bin/python bench/ingest.py --backends sqlite --ranks 256 --points 200000

For each backend it starts one server process (`uvicorn --factory
zerowatch.server.app:create_app`, the same app `zerowatch serve` runs) on 127.0.0.1, then:

1. **Ingest.** Simulated agents of one stage-3 run (zerowatch.simulate: every event carries
   its phases, two collective aggregates with histograms, memory, and raw spans every 10th
   step) POST gzip batches to `/api/v1/runs/{id}/events`, from `--clients` processes with
   `--threads` connections each, every connection sending its ranks' events one request
   after another. Payloads are built and compressed before the clock starts. Measured:
   rank-steps stored per second (all accepted events / wall time from the first request to
   the last answer), the latency of each POST (p50/p99), and the server process's CPU time
   per stored rank-step (user + system, from psutil): on a machine shared with other work
   the wall-clock rate is a lower bound, and 1e6 / (CPU µs per rank-step) is the rate one
   fully busy core sustains. Batch shapes: `--events-per-request` (2: the agent's default
   up to 512 ranks, flushing every 2 s, at one step a second; 1: steps of 2 s or more;
   16: the default at 4,096 ranks, whose agents flush every 16 s; 64: faster steps, or
   agents catching up after an outage). Each POST holds consecutive steps of one rank,
   encoded by the agent's codec.
2. **Queries.** A run of `--points` stored rank-steps (`--query-ranks` ranks) is written
   straight through the store (not timed), then the API is asked, `--repeats` times each:
   a downsampled series of one rank (step_time_s, a phase, a collective's bus bandwidth,
   500 points), the same series for every rank, the run resource, and compare. Measured:
   latency p50/p95 over HTTP.

PostgreSQL is started like the tests do (tests/support/postgres.py: initdb in a temp dir,
`fsync=off`); it is skipped with a note when its binaries are absent. The machine this
runs on matters: note its cores and load next to the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from zerowatch.agent import codec  # noqa: E402

from zerowatch import events as ev  # noqa: E402
from zerowatch import simulate  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SERVER_PIDS: dict[str, int] = {}


def server_cpu_s(url: str) -> float:
    """CPU seconds (user + system) the server process has used so far."""
    import psutil

    t = psutil.Process(SERVER_PIDS[url]).cpu_times()
    return float(t.user + t.system)


@contextlib.contextmanager
def server(db_url: str) -> Iterator[str]:
    """One zerowatch server process on a free port; yields its URL."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    env.update(ZEROWATCH_DB_URL=db_url, ZEROWATCH_MAX_BATCH_BYTES=str(64 * 2**20))
    log = tempfile.NamedTemporaryFile(prefix="zerowatch-bench-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "zerowatch.server.app:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(log.name).read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        SERVER_PIDS[url] = proc.pid
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# -- ingest ---------------------------------------------------------------------------------


def _bodies(
    spec: simulate.SimSpec, run_id: str, ranks: list[int], steps: int, per_request: int
) -> list[bytes]:
    """The POST bodies of `ranks`, as their agents send them: each rank's steps in order,
    `per_request` of one rank a batch, encoded and gzipped by the agent's codec; the ranks'
    first batches first, then their second ones, and so on."""
    t0 = time.time() - steps * spec.step_time_s
    per_rank = []
    for r in ranks:
        lines = [
            codec.encode(simulate.step_event(spec, r, s, t=t0 + (s + 1) * spec.step_time_s))
            for s in range(steps)
        ]
        per_rank.append(
            [codec.batch_body(run_id, lines[i : i + per_request])
             for i in range(0, steps, per_request)]
        )  # fmt: skip
    return [body for turn in zip(*per_rank, strict=True) for body in turn]


def _client(
    url: str,
    run_id: str,
    spec: simulate.SimSpec,
    ranks: list[int],
    steps: int,
    per_request: int,
    threads: int,
    start: Any,
    results: Any,
) -> None:
    """One agent process: `threads` connections, each posting its share of the ranks."""
    shares = [ranks[i::threads] for i in range(threads)]
    bodies = [_bodies(spec, run_id, share, steps, per_request) for share in shares]
    lat: list[float] = []
    accepted = [0]
    lock = threading.Lock()
    t_first: list[float] = []
    t_last: list[float] = []

    def conn(my: list[bytes]) -> None:
        # The standard library's client, one keep-alive connection: about a third of
        # httpx's CPU per POST, and this load generator shares the server's cores.
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        u = urllib.parse.urlsplit(url)
        c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=120)
        path = f"/api/v1/runs/{run_id}/events"
        try:
            mine, n = [], 0
            begin = time.perf_counter()
            for body in my:
                t = time.perf_counter()
                c.request("POST", path, body=body, headers=headers)
                r = c.getresponse()
                answer = r.read()
                mine.append(time.perf_counter() - t)
                if r.status != 200:
                    raise RuntimeError(f"POST {path}: {r.status} {answer[:300]!r}")
                n += json.loads(answer)["accepted"]
            end = time.perf_counter()
        finally:
            c.close()
        with lock:
            lat.extend(mine)
            accepted[0] += n
            t_first.append(begin)
            t_last.append(end)

    start.wait()
    ts = [threading.Thread(target=conn, args=(b,)) for b in bodies]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    results.put(
        {
            "lat": lat,
            "accepted": accepted[0],
            "first": min(t_first),
            "last": max(t_last),
            "wall0": time.time() - (time.perf_counter() - min(t_first)),
        }
    )


def bench_ingest(
    url: str,
    *,
    ranks: int,
    steps: int,
    per_request: int,
    clients: int,
    threads: int,
    settle: Any = None,
) -> dict[str, Any]:
    """Post the run's events and measure; `settle(run_id)`, when given, runs after the last
    answer and before the clock and the server's CPU are read (e.g. waiting until its
    compactor has rolled every step up, so that its work counts too)."""
    spec = simulate.SimSpec(
        name=f"bench-ingest-{per_request}",
        world_size=ranks,
        stage=3,
        spans_every=10,
        seed=per_request,
    )
    rc = simulate.run_create(spec)
    httpx.post(url + "/api/v1/runs", json=dataclasses.asdict(rc)).raise_for_status()
    ctx = mp.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_client,
            args=(
                url,
                rc.run_id,
                spec,
                list(range(ranks))[i::clients],
                steps,
                per_request,
                threads,
                start,
                results,
            ),
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(2.0 + ranks * steps / 4000)  # let every client build its payloads
    cpu0 = server_cpu_s(url)
    t0 = time.perf_counter()
    start.set()
    outs = [results.get(timeout=1800) for _ in procs]
    if settle is not None:
        settle(rc.run_id)
    wall = time.perf_counter() - t0
    cpu = server_cpu_s(url) - cpu0
    for p in procs:
        p.join()
    lat = [x for o in outs for x in o["lat"]]
    accepted = sum(o["accepted"] for o in outs)
    assert accepted == ranks * steps, (accepted, ranks * steps)
    stored = httpx.get(
        f"{url}/api/v1/runs/{rc.run_id}/ranks", params={"limit": 100000}, timeout=60
    ).json()
    assert sum(r["steps"] for r in stored["ranks"]) == ranks * steps
    return {
        "events_per_request": per_request,
        "requests": len(lat),
        "rank_steps": accepted,
        "wall_s": wall,
        "rank_steps_per_s": accepted / wall,
        "server_cpu_us_per_rank_step": cpu / accepted * 1e6,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
    }


# -- queries --------------------------------------------------------------------------------


def fill(db_url: str, *, ranks: int, points: int) -> str:
    """Write a run of `points` rank-steps through the store (cheap events: templates per
    rank with the step fields varied, memory records every 10th step as the agent sends
    them); returns its run id."""
    from zerowatch.server import store
    from zerowatch.server.db import Database

    steps = points // ranks
    spec = simulate.SimSpec(
        name="bench-query", world_size=ranks, stage=3, spans_every=0, grad_spike_at=steps // 3
    )
    db = Database.open(db_url)
    rc = simulate.run_create(spec, run_id="bench-query-" + uuid.uuid4().hex[:8])
    store.create_run(db, run=rc)
    templates = [simulate.step_event(spec, r, 1) for r in range(ranks)]
    rng = random.Random(0)
    t0 = time.time() - steps
    batch: list[Any] = []
    steps_per_batch = max(1, 4000 // ranks)
    for s in range(steps):
        for tpl in templates:
            total = tpl.step_time_s * rng.uniform(0.95, 1.05) * (3.0 if s == steps // 2 else 1.0)
            batch.append(
                dataclasses.replace(
                    tpl,
                    seq=s,
                    step=s,
                    time=t0 + s,
                    step_time_s=total,
                    grad_norm=(50.0 if s == steps // 3 else rng.uniform(0.8, 1.2)),
                    memory=tpl.memory if s % 10 == 0 else None,  # the agent's memory_every=10
                    phases={k: v * total / tpl.step_time_s for k, v in tpl.phases.items()},
                )
            )
        if (s + 1) % steps_per_batch == 0 or s == steps - 1:
            store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, batch))
            batch = []
    db.close()
    return rc.run_id


def bench_queries(url: str, run_id: str, *, repeats: int) -> list[dict[str, Any]]:
    run = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=60).json()
    mid = run["world_size"] // 2
    cases = [
        ("series step_time_s, 1 rank, 500 pts", "/series", {"metric": "step_time_s", "rank": mid}),
        ("series phase.backward, 1 rank", "/series", {"metric": "phase.backward", "rank": mid}),
        (
            "series collective.all_gather.busbw, 1 rank",
            "/series",
            {"metric": "collective.all_gather.busbw", "rank": mid},
        ),
        ("series step_time_s, all ranks", "/series", {"metric": "step_time_s"}),
        ("run resource", "", {}),
        ("compare (newest 100 steps)", None, {"runs": run_id}),
    ]
    out = []
    with httpx.Client(base_url=url, timeout=300) as c:
        for name, path, params in cases:
            target = "/api/v1/compare" if path is None else f"/api/v1/runs/{run_id}{path}"
            c.get(target, params=params).raise_for_status()  # warm
            lat: list[float] = []
            began = time.perf_counter()
            # `repeats` times, but at most ~20 s per query (and at least 5 samples)
            while len(lat) < repeats and (len(lat) < 5 or time.perf_counter() - began < 20):
                t = time.perf_counter()
                r = c.get(target, params=params)
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
            extra = ""
            if path == "/series":
                body = r.json()
                pts = sum(len(s["values"]) for s in body["series"])
                stored = sum(s["points"] for s in body["series"])
                extra = f"{stored} stored -> {pts} returned"
            out.append(
                {
                    "n": len(lat),
                    "query": name,
                    "p50_ms": pct(lat, 0.5) * 1e3,
                    "p95_ms": pct(lat, 0.95) * 1e3,
                    "note": extra,
                }
            )
    return out


# -- main -----------------------------------------------------------------------------------


@contextlib.contextmanager
def backend(name: str) -> Iterator[str | None]:
    if name == "sqlite":
        with tempfile.TemporaryDirectory(prefix="zerowatch-bench-") as d:
            yield f"sqlite:///{d}/zerowatch.db"
        return
    from support.postgres import postgres, postgres_available

    if not postgres_available():
        yield None
        return
    with postgres() as pg:
        yield pg.create_database("bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--ranks", type=int, default=512, help="ranks of the ingest run")
    ap.add_argument("--steps", type=int, default=12, help="steps per rank in the ingest run")
    ap.add_argument(
        "--events-per-request", default="1,2,16,64", help="batch sizes to measure, comma-separated"
    )
    ap.add_argument("--clients", type=int, default=2, help="agent processes")
    ap.add_argument("--threads", type=int, default=8, help="connections per agent process")
    ap.add_argument("--points", type=int, default=1_000_000, help="rank-steps of the query run")
    ap.add_argument("--query-ranks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--skip-queries", action="store_true")
    args = ap.parse_args()

    print(
        f"# zerowatch ingest benchmark  ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
    )
    for name in args.backends.split(","):
        with backend(name) as db_url:
            if db_url is None:
                print(f"\n## {name}: skipped (binaries not installed)")
                continue
            print(f"\n## {name}\n")
            if not args.skip_ingest:
                ingest_table(db_url, args)
            if not args.skip_queries:
                query_table(db_url, args)


def ingest_table(db_url: str, args: argparse.Namespace) -> None:
    """Print the ingest table of one backend (fresh server process)."""
    with server(db_url) as url:
        print(
            "| events/request | requests | rank-steps | wall s | rank-steps/s | p50 ms | p99 ms"
            " | server CPU µs/rank-step | rank-steps/s per busy core |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for per in sorted({int(x) for x in args.events_per_request.split(",")}):
            steps = args.steps if per > 1 else max(2, args.steps // 2)
            r = bench_ingest(
                url,
                ranks=args.ranks,
                steps=steps,
                per_request=per,
                clients=args.clients,
                threads=args.threads,
            )
            print(
                f"| {per} | {r['requests']} | {r['rank_steps']} | {r['wall_s']:.1f} | "
                f"**{r['rank_steps_per_s']:.0f}** | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                f"{r['server_cpu_us_per_rank_step']:.0f} | {1e6 / r['server_cpu_us_per_rank_step']:.0f} |",
                flush=True,
            )


def query_table(db_url: str, args: argparse.Namespace) -> None:
    """Write the query run, then print the query table (fresh server process)."""
    t = time.perf_counter()
    run_id = fill(db_url, ranks=args.query_ranks, points=args.points)
    print(
        f"\nquery run: {args.points} rank-steps ({args.query_ranks} ranks x "
        f"{args.points // args.query_ranks} steps) written in {time.perf_counter() - t:.0f} s\n"
    )
    with server(db_url) as url:
        print("| query | n | p50 ms | p95 ms | points |")
        print("|---|---|---|---|---|")
        for q in bench_queries(url, run_id, repeats=args.repeats):
            print(
                f"| {q['query']} | {q['n']} | {q['p50_ms']:.1f} | **{q['p95_ms']:.1f}** | {q['note']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
