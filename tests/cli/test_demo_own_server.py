"""`zerowatch demo` sends its runs only to the server it started, never to another process
that answers /healthz on the port it asked for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from support.live_server import LiveServer

from zerowatch.demo import ServerStartError, wait_for_own_server


class ForeignServer:
    """An HTTP server that is not the demo's: 200 to every request, each one recorded."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        record = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                record.append(f"{self.command} {self.path}")
                body = json.dumps({"status": "ok", "database": "sqlite", "version": "9"})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            do_GET = do_POST = _answer

            def log_message(self, *_args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"


@pytest.fixture
def foreign() -> Iterator[ForeignServer]:
    server = ForeignServer()
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def test_a_foreign_server_answering_healthz_is_not_taken_for_the_demos_own(
    foreign: ForeignServer,
) -> None:
    # A child that is alive but does not serve: only the foreign server answers the port.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ServerStartError, match=r"another server answers.*--port"):
            wait_for_own_server(foreign.url, child, timeout_s=20)
    finally:
        child.kill()
        child.wait()
    assert foreign.requests == ["GET /healthz"]


def test_a_child_that_exits_before_it_is_ready_is_reported_naming_port(
    foreign: ForeignServer,
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    child.wait()
    with pytest.raises(ServerStartError, match=r"exited with code 2.*--port"):
        wait_for_own_server(foreign.url, child, timeout_s=20)
    assert foreign.requests == []


@pytest.mark.slow
def test_demo_on_a_port_a_foreign_server_holds_runs_on_a_free_port_and_says_so(
    foreign: ForeignServer, tmp_path: Path
) -> None:
    db = tmp_path / "demo.db"
    proc = subprocess.run(
        [sys.executable, "-m", "zerowatch.cli", "demo", "--stages", "1", "--world-size", "1",
         "--steps", "2", "--port", str(foreign.port), "--db", f"sqlite:///{db}", "--no-serve"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env=dict(os.environ, COLUMNS="200"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"port {foreign.port} is in use" in proc.stdout and "--port" in proc.stdout
    assert foreign.requests == []  # not even a /healthz: the demo checked the port first

    ports = set(re.findall(r"http://127\.0\.0\.1:(\d+)/", proc.stdout))
    assert ports and str(foreign.port) not in ports, proc.stdout
    run_id = re.search(r"ZeRO-1 run:\s+http://127\.0\.0\.1:\d+/runs/(\S+)", proc.stdout)
    assert run_id, proc.stdout
    with LiveServer(db_url=f"sqlite:///{db}") as server:  # the runs are in the demo's database
        run = httpx.get(f"{server.api}/runs/{run_id.group(1)}", timeout=10).json()
        assert run["status"] == "finished"
        assert [(r["rank"], r["steps"]) for r in run["ranks"]] == [(0, 2)]
