"""`zerowatch trace` and `zerowatch runs` against a server holding a real instrumented run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.live_server import LiveServer
from support.ports import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, str]]:
    """A 2-rank ZeRO-2 training of the example GPT, instrumented, shipped to a live server."""
    with LiveServer() as server:
        cwd = tmp_path_factory.mktemp("train")
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "zerowatch.examples.train", "--stage", "2", "--steps", "12",
             "--d-model", "64", "--server", server.url, "--name", "trace-me"],
            capture_output=True, text=True, timeout=240, cwd=cwd,
            env=dict(os.environ, OMP_NUM_THREADS="1", ZEROWATCH_PRINT_RUN="1"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        run_id = next(
            line.split()[1] for line in proc.stdout.splitlines() if line.startswith("run ")
        )
        yield server, run_id


def zerowatch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", *args],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"),
    )  # fmt: skip


def test_trace_of_a_real_run_is_chrome_trace_json_with_one_process_per_rank(
    real_run: tuple[LiveServer, str], tmp_path: Path
) -> None:
    server, run_id = real_run
    out = tmp_path / "trace.json"
    proc = zerowatch("trace", run_id, "--server", server.url, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(out.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    assert sorted(names.values()) == ["rank 0", "rank 1"]
    slices = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in slices} == set(names)
    for e in slices:  # Chrome-trace complete events: microsecond start and duration
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["name"]
    slice_names = {e["name"] for e in slices}
    assert {"forward", "backward", "optimizer_step"} <= slice_names
    assert any(n in slice_names for n in ("reduce_scatter", "all_gather", "all_reduce")), (
        slice_names
    )


def test_trace_steps_range_limits_the_slices(real_run: tuple[LiveServer, str]) -> None:
    server, run_id = real_run
    full = json.loads(zerowatch("trace", run_id, "--server", server.url).stdout)
    part = json.loads(zerowatch("trace", run_id, "--server", server.url, "--steps", "0:1").stdout)

    def count(t: object) -> int:
        events = t["traceEvents"] if isinstance(t, dict) else t
        return sum(1 for e in events if e.get("ph") == "X")

    assert 0 < count(part) < count(full)


def test_trace_of_an_unknown_run_fails_with_a_clear_error(real_run: tuple[LiveServer, str]) -> None:
    server, _ = real_run
    proc = zerowatch("trace", "no-such-run", "--server", server.url)
    assert proc.returncode == 1
    assert "404" in proc.stderr and "Traceback" not in proc.stderr


def test_runs_lists_the_run(real_run: tuple[LiveServer, str]) -> None:
    server, run_id = real_run
    proc = zerowatch("runs", "--server", server.url)
    assert proc.returncode == 0, proc.stderr
    assert run_id in proc.stdout and "finished" in proc.stdout
    assert httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()["ranks"][0]["steps"] == 12


def test_commands_fail_cleanly_when_the_server_is_down() -> None:
    proc = zerowatch("runs", "--server", f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    assert "cannot reach" in proc.stderr and "Traceback" not in proc.stderr
