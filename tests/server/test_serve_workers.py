"""`zerowatch serve --workers 2` on PostgreSQL: both worker processes start (the deadline
protocol reaches them by pickling, as uvicorn hands its config to its workers), answer, and
close a connection that sends nothing at the head deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
from support.ports import free_port

HEAD_S = 1.0


def test_two_workers_start_answer_and_keep_the_head_deadline(pg_server: Any, tmp_path) -> None:
    url = str(pg_server.create_database("workers"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    env.update(ZEROWATCH_DB_URL=url, ZEROWATCH_HEAD_TIMEOUT_S=str(HEAD_S))
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        # (cwd: not the repository's root, whose zerowatch/ folder is not the installed package)
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port), "--workers", "2"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        answered = False
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/runs", timeout=5)
                answered = r.status_code == 200
                if answered:
                    break
            time.sleep(0.3)
        assert answered, f"serve --workers 2 did not answer: {log.read_text()[-3000:]}"
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(10)
            t0 = time.monotonic()
            assert s.recv(1) == b""  # closed by the server, not by the 10 s timeout
            assert time.monotonic() - t0 >= HEAD_S * 0.9
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
