"""A real zerowatch server in a subprocess, for tests that need one over HTTP.

    from support.live_server import LiveServer

    with LiveServer() as server:              # temp SQLite file, free port, no token
        httpx.get(server.url + "/healthz")
        server.kill()                         # SIGKILL, like a crash
        server.start()                        # same port, same database
    # stopped (by its pid) and its temp folder removed

Options (all keyword-only): `db_url` (default: a SQLite file in a temp folder; pass a
PostgreSQL URL from support.postgres to use that), `token`, `port` (default: a free one),
`settings` (more ZEROWATCH_* settings by name, e.g. {"stalled_after_s": 5,
"finished_grace_s": 30}), `env` (extra environment). The server runs as
`python -m uvicorn --factory zerowatch.server.app:create_app` with its settings in the
environment, exactly as `zerowatch serve` would configure it; its output goes to
`server.log_path` (shown in the error when it fails to start).

Attributes: `url` ("http://127.0.0.1:PORT"), `api` (url + "/api/v1"), `port`, `db_url`,
`pid`, `token`, `headers` (the Authorization header when a token is set).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PortTaken(RuntimeError):
    """The picked port was bound by another process first."""


class LiveServer:
    """A zerowatch server process on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        *,
        db_url: str | None = None,
        token: str | None = None,
        port: int | None = None,
        settings: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="zerowatch-server-"))
        self.db_url = db_url or f"sqlite:///{self._tmp / 'zerowatch.db'}"
        self.token = token
        self._pick_port = port is None
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = self.url + "/api/v1"
        self.log_path = self._tmp / "server.log"
        self.startup_timeout_s = startup_timeout_s
        self._env = dict(os.environ)
        for key in list(self._env):
            if key.startswith("ZEROWATCH_"):
                del self._env[key]
        self._env["ZEROWATCH_DB_URL"] = self.db_url
        if token:
            self._env["ZEROWATCH_TOKEN"] = token
        for name, value in (settings or {}).items():
            self._env[f"ZEROWATCH_{name.upper()}"] = str(value)
        self._env.update(env or {})
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LiveServer:
        """Start the process and wait until /healthz answers 200.

        A free port picked here can be taken by another process before the server binds
        it; when the server then exits on "address already in use", it is started again on
        a newly picked port (a port given by the caller, or one a started server has held,
        is never changed)."""
        for _ in range(5):
            try:
                return self._start_once()
            except _PortTaken:
                self.port = _free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.api = self.url + "/api/v1"
        return self._start_once()

    def _start_once(self) -> LiveServer:
        if self.running():
            return self
        cmd = [
            sys.executable, "-m", "uvicorn", "--factory", "zerowatch.server.app:create_app",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        log_start = log.tell()
        try:
            self._proc = subprocess.Popen(
                cmd, env=self._env, stdout=log, stderr=subprocess.STDOUT, cwd=self._tmp
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                this_start = self.log_path.read_bytes()[log_start:].decode(errors="replace")
                if self._pick_port and "address already in use" in this_start.lower():
                    raise _PortTaken(f"port {self.port} was taken before the server bound it")
                raise RuntimeError(
                    f"zerowatch server exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                ok = httpx.get(self.url + "/healthz", timeout=2).status_code == 200
                if ok and self._proc.poll() is None:  # not another process on a taken port
                    self._pick_port = False  # a restart keeps this port
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"zerowatch server did not answer /healthz in time:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (by its pid), SIGKILL it if it lingers."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL the server at once (a crash); `start()` brings it back on the same port."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def restart(self) -> LiveServer:
        self.stop()
        return self.start()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the server and remove its temp folder (and SQLite file)."""
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LiveServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LiveServer"]
