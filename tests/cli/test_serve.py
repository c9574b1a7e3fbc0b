"""`zerowatch serve` at the front door: it says which database it opened, and a taken port is
a one-line usage error naming --port, before any start-up."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from support.ports import free_port


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}


@contextlib.contextmanager
def _serving(cwd: Path) -> Iterator[tuple[int, subprocess.Popen[str], str]]:
    """`zerowatch serve` on a free port in `cwd`: yields (port, process, its first printed
    line), then ends it with SIGINT (Ctrl-C)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd, env=_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        yield port, proc, proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_serve_on_a_port_in_use_exits_2_naming_port_before_start_up() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=60, env=_env(),
        )  # fmt: skip
    assert proc.returncode == 2
    assert f"port {port}" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in proc.stderr and "startup" not in proc.stderr.lower()


def test_serve_prints_the_sqlite_file_it_opened_as_an_absolute_path(tmp_path: Path) -> None:
    with _serving(tmp_path) as (port, _, first):
        pass
    assert first.strip() == (
        f"zerowatch server on http://127.0.0.1:{port} (database sqlite:///{tmp_path / 'zerowatch.db'})"
    )


def test_serve_prints_a_database_url_without_its_password() -> None:
    url = "postgresql+psycopg://watcher:s3cret@127.0.0.1:1/zerowatch"  # nothing listens on :1
    proc = subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=dict(_env(), ZEROWATCH_DB_URL=url),
    )  # fmt: skip
    first = proc.stdout.splitlines()[0]
    assert "postgresql+psycopg://watcher:***@127.0.0.1:1/zerowatch" in first
    assert "s3cret" not in proc.stdout


def test_serve_keeps_an_agents_connection_open_between_its_flushes(tmp_path: Path) -> None:
    """An idle connection outlives uvicorn's default keep-alive (5 s): an agent that flushes
    every few seconds POSTs over one connection; and the process may hold one per rank (its
    soft open-files limit raised to the hard one)."""
    import http.client
    import time

    from zerowatch.agent.config import MAX_FLUSH_INTERVAL_S
    from zerowatch.server.app import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > MAX_FLUSH_INTERVAL_S
    with _serving(tmp_path) as (port, proc, _):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(300):  # until the app answers
            try:
                conn.request("GET", "/healthz")
                if conn.getresponse().read() and conn.sock is not None:
                    break
            except OSError:
                conn.close()
            time.sleep(0.1)
        sock = conn.sock
        time.sleep(6.5)  # idle past uvicorn's default keep-alive
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        assert conn.sock is sock  # the same connection: the server kept it open
        conn.close()
        limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
        soft, hard = next(ln for ln in limits if ln.startswith("Max open files")).split()[3:5]
        assert soft == hard or int(soft) >= 1_048_576, (soft, hard)
