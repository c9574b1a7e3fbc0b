"""Stopping `zerowatch demo` while it serves the dashboards: however the stop arrives (a
terminal's Ctrl-C to the whole process group, pressed twice, or a SIGTERM to the demo alone),
the demo stops its server with one signal, the server closes its database, so that no SQLite
`-wal` file (19-36 MB after a demo) is left beside it, and no server process outlives it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _ctrl_c(demo: subprocess.Popen[bytes]) -> None:
    os.killpg(demo.pid, signal.SIGINT)


def _ctrl_c_twice(demo: subprocess.Popen[bytes]) -> None:
    # The second press lands while the demo and its server are stopping: a server that got
    # both (uvicorn takes a second SIGINT as "quit now") would skip closing its database.
    os.killpg(demo.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(demo.pid, signal.SIGINT)


def _sigterm_to_the_demo(demo: subprocess.Popen[bytes]) -> None:
    demo.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("stop", [_ctrl_c, _ctrl_c_twice, _sigterm_to_the_demo],
                         ids=["ctrl-c", "ctrl-c-twice", "sigterm"])  # fmt: skip
def test_stopping_the_serving_demo_closes_its_database_and_leaves_no_wal(
    tmp_path: Path, stop: Callable[[subprocess.Popen[bytes]], None]
):
    db = tmp_path / "demo.db"
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:
        # A session of its own: the process group a terminal's Ctrl-C signals as one.
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerowatch.cli", "demo", "--stages", "1", "--steps", "3",
             "--port", "0", "--db", f"sqlite:///{db}"],
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            env=dict(os.environ, COLUMNS="200", TMPDIR=str(tmp_path)),
        )  # fmt: skip
    server: psutil.Process | None = None
    try:
        deadline = time.monotonic() + 240
        while "press Ctrl-C" not in out.read_text(errors="replace"):
            assert proc.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.2)
        assert Path(f"{db}-wal").exists()  # the server holds the database open
        (server,) = psutil.Process(proc.pid).children()
        stop(proc)
        assert proc.wait(timeout=60) == 0, out.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        outlived = server is not None and server.is_running()
        if server is not None and outlived:
            server.kill()  # asserted against below; stopped here so that nothing outlives it
    text = out.read_text(errors="replace")
    server_log = "".join(p.read_text() for p in tmp_path.glob("zerowatch-demo-*/server.log"))
    assert "Traceback" not in text, text
    assert not outlived, "the server outlived the demo"
    assert "Application shutdown complete" in server_log, server_log
    assert not Path(f"{db}-wal").exists(), text + server_log
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (1,)
