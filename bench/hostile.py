"""Real agents beside hostile clients: does a job's ingest hold while the server is abused?

    .venv/bin/python bench/hostile.py                  # 5 min quiet, then 5 min hostile
    .venv/bin/python bench/hostile.py --minutes 1      # a short look

One `zerowatch serve` (SQLite, a token, its default edge: head and body deadlines, Host
check) and one job of `--ranks` simulated ranks (the agent's real Transport and HTTP client,
a step a second each; bench/faults.py's workers). For `--minutes` the agents are alone (the
baseline), then for `--minutes` more, beside them, in another process:

- `--slow-bodies` (130) unauthenticated POSTs of events that declare 100,000 bytes and send
  one every 2 s, each opened again 2 s after the server answers or closes it;
- `--idle` (500) connections that send nothing, reopened when closed;
- an error bomb a second: 16,384 empty events in 135 gzipped bytes, with the token;
- a trace export of the job every 2 s.

Printed per phase: the agents' event POSTs (count, p50, p95, max, answers other than 200),
the rank-steps stored per second, and the server's resident memory and open files at its
end; and what the hostile clients got (connections closed by the server, answers).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from faults import MB, Workers, pct, proc_status  # noqa: E402
from support.ports import free_port  # noqa: E402
from support.sim_agents import run_create_json  # noqa: E402

from zerowatch import simulate  # noqa: E402

TOKEN = "bench-token"


# -- the hostile clients (their own process) --------------------------------------------------


async def _slow_body(port: int, run_id: str, stop: asyncio.Event, got: Counter[str]) -> None:
    head = (f"POST /api/v1/runs/{run_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{").encode()  # fmt: skip
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            while not stop.is_set():
                try:
                    data = await asyncio.wait_for(reader.read(4096), 2.0)
                except TimeoutError:  # nothing from the server: one more byte
                    writer.write(b" ")
                    await writer.drain()
                    continue
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
                got[f"slow body answered {status}"] += 1
                break
            writer.close()
            await asyncio.sleep(2.0)  # and again, at the pace of its bytes
        except OSError:
            got["slow body refused or reset"] += 1
            await asyncio.sleep(0.5)


async def _idle(port: int, stop: asyncio.Event, got: Counter[str]) -> None:
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = await reader.read(1024)  # b"": closed by the server
            got["idle closed by the server"] += not data
            writer.close()
        except OSError:
            got["idle refused or reset"] += 1
            await asyncio.sleep(0.5)


async def _bombs_and_traces(port: int, run_id: str, stop: asyncio.Event, got: Counter[str]) -> None:
    bomb = gzip.compress(json.dumps({"run_id": run_id, "events": [{}] * 16384}).encode())
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip",
               "Content-Type": "application/json"}  # fmt: skip
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        n = 0
        while not stop.is_set():
            try:
                r = await c.post(f"/api/v1/runs/{run_id}/events", content=bomb, headers=headers)
                got[f"error bomb {r.status_code}"] += 1
                if n % 2 == 0:
                    r = await c.get(f"/api/v1/runs/{run_id}/trace")
                    got[f"trace {r.status_code}"] += 1
            except httpx.HTTPError as e:
                got[f"bomb/trace {type(e).__name__}"] += 1
            n += 1
            await asyncio.sleep(1.0)


def _hostile(port: int, run_id: str, slow: int, idle: int, seconds: float, out: Any) -> None:
    async def main() -> Counter[str]:
        stop, got = asyncio.Event(), Counter[str]()
        tasks = [asyncio.create_task(_slow_body(port, run_id, stop, got)) for _ in range(slow)]
        tasks += [asyncio.create_task(_idle(port, stop, got)) for _ in range(idle)]
        tasks.append(asyncio.create_task(_bombs_and_traces(port, run_id, stop, got)))
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.wait(tasks, timeout=15)
        return got

    out.send(dict(asyncio.run(main())))


# -- the run ----------------------------------------------------------------------------------


def stored(db: Path, run_id: str) -> int:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT COALESCE(SUM(rs.steps), 0) FROM rank_states rs JOIN runs r "
                           "ON r.id = rs.run WHERE r.run_id = ?", (run_id,)).fetchone()  # fmt: skip
    return int(row[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="per phase")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--slow-bodies", type=int, default=130)
    ap.add_argument("--idle", type=int, default=500)
    args = ap.parse_args()
    phase_s = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="zerowatch-hostile-") as d:
        tmp, port = Path(d), free_port()
        db = tmp / "zerowatch.db"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
        env.update(ZEROWATCH_DB_URL=f"sqlite:///{db}", ZEROWATCH_TOKEN=TOKEN)
        server = subprocess.Popen([sys.executable, "-m", "zerowatch.cli", "serve", "--port",
                                   str(port)], env=env, cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            spec = simulate.SimSpec(world_size=args.ranks, spans_every=10)
            run_id = f"hostile-{uuid.uuid4().hex[:8]}"
            httpx.post(f"{base}/api/v1/runs", content=run_create_json(spec, run_id), timeout=60,
                       headers={"Content-Type": "application/json",
                                "Authorization": f"Bearer {TOKEN}"}).raise_for_status()  # fmt: skip
            workers = Workers(base, spec, run_id, tmp / "spool", procs=1, outage_steps=0,
                              step_s=1.0, token=TOKEN)  # fmt: skip
            workers.expect("ready")
            t0 = time.monotonic()
            workers.go.set()
            time.sleep(phase_s)
            quiet = (time.monotonic(), stored(db, run_id), proc_status(server.pid))
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            hostile = ctx.Process(target=_hostile, args=(port, run_id, args.slow_bodies,
                                                         args.idle, phase_s, child))  # fmt: skip
            hostile.start()
            hostile.join(phase_s + 60)
            got = parent.recv() if parent.poll(5) else {}
            loud = (time.monotonic(), stored(db, run_id), proc_status(server.pid))
            done = workers.finish()
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(60)
    posts = [p for w in done for p in w["posts"]]
    print(f"\nHostile clients: {args.ranks} simulated ranks at a step a second, {args.minutes} "
          f"min alone then {args.minutes} min beside {args.slow_bodies} slow unauthenticated "
          f"bodies, {args.idle} idle connections, an error bomb a second and a trace export "
          f"every 2 s ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})\n")  # fmt: skip
    print(
        "| phase | agent POSTs | p50 | p95 | max | not 200 | rank-steps stored / s | "
        "server RSS MB | open files |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    windows = (("agents alone", t0, quiet[0], 0, quiet[1], quiet[2]),
               ("beside hostile clients", quiet[0], loud[0], quiet[1], loud[1], loud[2]))  # fmt: skip
    for name, w0, w1, s0, s1, st in windows:
        ps = [(dur, code) for (t, dur, code) in posts if w0 <= t < w1]
        ok = [dur for dur, code in ps if code == 200]
        print(f"| {name} | {len(ps)} | {pct(ok, 0.5) * 1e3:.0f} ms | {pct(ok, 0.95) * 1e3:.0f} ms"
              f" | {max(ok, default=float('nan')) * 1e3:.0f} ms | {len(ps) - len(ok)} | "
              f"{(s1 - s0) / (w1 - w0):.1f} | {st['VmRSS'] / MB:.0f} | {st['fds']} |")  # fmt: skip
    print(
        "\nWhat the hostile clients got: " + ", ".join(f"{k}: {v}" for k, v in sorted(got.items()))
    )
    print(f"Every rank's steps stored: {stored_all(done, args.ranks)}")


def stored_all(done: list[dict[str, Any]], ranks: int) -> str:
    accepted = sum(w["accepted"] for w in done)
    n = done[0]["next_step"]
    return f"{accepted:,} of {n * ranks:,} acknowledged"


if __name__ == "__main__":
    main()
