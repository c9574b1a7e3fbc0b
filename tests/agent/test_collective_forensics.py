"""Hangs and desyncs of a real 2-rank gloo job, named while they happen: the findings API
and `zerowatch doctor` say which rank waits in which collective (group, seq, op) and which
rank is elsewhere, with its stack, from the heartbeats the ranks' shipper threads keep
sending while their training threads are blocked."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.multiprocessing as mp
from forensics_jobs import (
    hangs_in_loader,
    load_batch,
    one_extra_collective,
    wrapped_calls_numbered,
)
from support.engine_harness import _entry, run_ranks
from support.live_server import LiveServer

pytestmark = pytest.mark.slow

WORLD = 2


@contextmanager
def _job(fn: Any, *args: Any) -> Any:
    """`fn(rank, WORLD, *args)` on WORLD gloo ranks that may never return: killed on exit."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, WORLD, out, fn, args, 600.0), daemon=True)
                 for r in range(WORLD)]  # fmt: skip
        for p in procs:
            p.start()
        try:
            yield procs
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)


def _progress(steps_file: Path) -> tuple[str, int] | None:
    try:
        run_id, step = steps_file.read_text().split()
        return run_id, int(step)
    except (OSError, ValueError):
        return None


def _wait_for_finding(server: LiveServer, steps_file: Path, kind: str, limit_s: float,
                      after_step: int) -> tuple[str, dict[str, Any], float]:  # fmt: skip
    """(run id, the first finding of `kind`, seconds from the last step rank 0 wrote to it)."""
    deadline = time.monotonic() + 180
    last: tuple[str, int] | None = None
    last_at = time.monotonic()
    while time.monotonic() < deadline:
        now = _progress(steps_file)
        if now != last:
            last, last_at = now, time.monotonic()
        if last is not None and last[1] >= after_step:
            got = httpx.get(f"{server.api}/runs/{last[0]}/findings", timeout=10).json()
            found = [f for f in got["findings"] if f["kind"] == kind]
            if found:
                return last[0], found[0], time.monotonic() - last_at
        time.sleep(0.5)
    raise AssertionError(f"no {kind} finding within 180 s (progress {last})\n{server.log_tail()}")


def test_rank_stuck_in_its_loader_is_named_with_its_stack_while_the_other_waits(
    tmp_path, monkeypatch
):
    # torch's own flight recorder on (the ranks' groups are made after the spawn), and the
    # engine's collectives torch's own (as on NCCL), not its gloo ring over send/recv.
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    monkeypatch.setenv("ZEROWATCH_GLOO_RING", "0")
    steps_file = tmp_path / "steps"
    with LiveServer() as server, _job(hangs_in_loader, server.url, str(tmp_path / "spool"), 1,
                                      12, str(steps_file)) as procs:  # fmt: skip
        # How soon it is named is printed (2.2 s here, with a 2 s stall threshold), not
        # asserted: a slower machine only takes longer; the wait gives up at 180 s.
        run_id, hang, after_s = _wait_for_finding(server, steps_file, "hang", 60, 11)
        print(
            f"\nhang named {after_s:.1f} s after rank 0's last step:\n{json.dumps(hang, indent=1)}"
        )
        assert hang["severity"] == "critical"
        assert hang["ranks"] == [1]
        coll = hang["evidence"]["collective"]
        assert hang["evidence"]["waiting"]["ranks"] == [0]
        assert coll["op"] in ("all_reduce", "reduce_scatter", "all_gather") and coll["seq"] > 0
        assert f"#{coll['seq']} on group {coll['group']}" in hang["message"]
        (stuck,) = hang["evidence"]["not_launched"]
        assert stuck["ranks"] == [1] and stuck["last_step"] == 11
        line = next(i for i, text in enumerate(inspect.getsourcelines(load_batch)[0])
                    if "never.wait()" in text) + load_batch.__code__.co_firstlineno  # fmt: skip
        frames = [(Path(f["file"]).name, f["function"], f["line"]) for f in stuck["stack"]]
        assert ("forensics_jobs.py", "load_batch", line) in frames, frames
        assert "load_batch (" in hang["message"] and f"forensics_jobs.py:{line}" in hang["message"]
        # The waiting rank's heartbeat carries torch's own entries: what the group has in
        # flight, not retired (the engine's gloo reduce-scatter is torch's all_reduce).
        entries = hang["evidence"]["waiting"]["torch_flight"]
        pending = [e for e in entries if not e["retired"]]
        ops = {"gloo:all_reduce", "gloo:reduce_scatter", "gloo:all_gather"}
        assert pending and pending[0]["op"] in ops and pending[0]["sizes"], entries
        assert (
            f"torch's flight recorder on rank 0: {pending[0]['op']} #{pending[0]['seq']}"
            in (hang["message"])
        )
        # The doctor on the command line says the same.
        cli = subprocess.run(
            [sys.executable, "-m", "zerowatch.cli", "doctor", run_id, "--server", server.url,
             "--json"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        doc = json.loads(cli.stdout)
        (same,) = [f for f in doc["findings"] if f["kind"] == "hang"]
        assert same["ranks"] == [1] and same["evidence"]["collective"]["seq"] == coll["seq"]
        text = subprocess.run(
            [sys.executable, "-m", "zerowatch.cli", "doctor", run_id, "--server", server.url],
            capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        assert "hang" in text and "load_batch" in text
        # The job is killed: every step both ranks finished before is stored.
        for p in procs:
            p.kill()
            p.join(10)
        run = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
        by_rank = {r["rank"]: r for r in run["ranks"]}
        assert by_rank[1]["last_step"] == 11 and by_rank[1]["steps"] == 12
        assert by_rank[0]["last_step"] == 11 and by_rank[0]["steps"] == 12


def test_a_collective_issued_on_one_rank_only_is_a_desync_naming_both_ops(tmp_path):
    steps_file = tmp_path / "steps"
    with LiveServer() as server, _job(one_extra_collective, server.url, str(tmp_path / "spool"),
                                      1, 8, str(steps_file)):  # fmt: skip
        _, desync, _ = _wait_for_finding(server, steps_file, "desync", 60, 7)
        print(f"\n{json.dumps(desync, indent=1)}")
        assert desync["severity"] == "critical"
        assert sorted(desync["ranks"]) == [0, 1]
        variants = {tuple(v["ranks"]): v for v in desync["evidence"]["variants"]}
        assert variants[(1,)]["op"] == "all_reduce" and variants[(1,)]["elements"] == 3
        assert variants[(0,)]["elements"] != 3
        assert (
            "rank 0: " in desync["message"]
            and "rank 1: all_reduce of 3 float32" in desync["message"]
        )


def test_collectives_through_dist_wrap_are_numbered_and_announced_before_they_run():
    for res in run_ranks(wrapped_calls_numbered, WORLD):
        assert res["launches"] == [("0", 1, "all_reduce", 10, "torch.float32"),
                                   ("0", 2, "all_reduce", 4, "torch.float32"),
                                   ("0", 3, "broadcast", 3, "torch.float64")]  # fmt: skip
        assert res["records"] == [("0", 1, "all_reduce"), ("0", 2, "all_reduce"),
                                  ("0", 3, "broadcast")]  # fmt: skip
        group = res["flight"]["0"]
        assert (group["launched"], group["completed"]) == (3, 3)
        assert [c[4] for c in group["calls"]] == ["completed"] * 3
        assert group["calls"][2][1:4] == ["broadcast", 3, "float64"]
