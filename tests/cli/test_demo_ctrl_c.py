"""Ctrl-C on `zerowatch demo` while it serves the dashboards: the terminal's SIGINT reaches
the demo and its server alike, and the server still closes its database, so that no SQLite
`-wal` file (19-36 MB after a demo) is left beside it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_ctrl_c_on_the_serving_demo_closes_its_database_and_leaves_no_wal(tmp_path: Path):
    db = tmp_path / "demo.db"
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:
        # A session of its own: the process group a terminal's Ctrl-C signals as one.
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerowatch.cli", "demo", "--stages", "1", "--steps", "3",
             "--port", "0", "--db", f"sqlite:///{db}"],
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            env=dict(os.environ, COLUMNS="200"),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while "press Ctrl-C" not in out.read_text(errors="replace"):
            assert proc.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.2)
        assert Path(f"{db}-wal").exists()  # the server holds the database open
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, out.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text(errors="replace")
    assert "Traceback" not in text, text
    assert not Path(f"{db}-wal").exists(), text
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (1,)
