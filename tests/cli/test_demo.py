"""`zerowatch demo` end to end: a server, real torchrun runs of the engine, the summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.live_server import LiveServer

pytestmark = pytest.mark.slow


def test_demo_runs_stages_1_and_3_and_stores_every_step_of_every_rank(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    proc = subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", "demo", "--stages", "1,3", "--steps", "5",
         "--port", "0", "--db", f"sqlite:///{db}", "--no-serve"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, COLUMNS="200"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # The summary: one row per stage, model state measured against theory, addresses.
    rows = {m.group(1): m.group(0) for m in re.finditer(r"│\s+([013])\s+│.*", out)}
    assert set(rows) == {"1", "3"}, out
    for row in rows.values():
        ratio = float(re.findall(r"│\s+([0-9.]+)\s+│", row)[-1])
        assert 0.9 <= ratio <= 1.1, row
    ids = re.findall(r"ZeRO-[13] run:\s+http://127\.0\.0\.1:\d+/runs/(\S+)", out)
    assert len(ids) == 2, out
    assert "/compare?runs=" in out

    # The server is gone (--no-serve); a new one on the same database holds both runs.
    with LiveServer(db_url=f"sqlite:///{db}") as server:
        for run_id in ids:
            run = httpx.get(f"{server.api}/runs/{run_id}", timeout=10).json()
            assert run["status"] == "finished"
            assert run["world_size"] == 2
            assert [(r["rank"], r["steps"], r["last_step"]) for r in run["ranks"]] == [
                (0, 5, 4),
                (1, 5, 4),
            ]
        stages = sorted(
            httpx.get(f"{server.api}/runs/{i}", timeout=10).json()["zero_stage"] for i in ids
        )
        assert stages == [1, 3]


def test_demo_rejects_a_bad_stage_list_with_exit_code_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", "demo", "--stages", "1,7"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--stages" in proc.stderr
    assert "Traceback" not in proc.stderr
