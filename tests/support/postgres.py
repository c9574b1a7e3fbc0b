"""A real, throwaway PostgreSQL for tests (Debian package `postgresql`, binaries under
/usr/lib/postgresql/<version>/bin).

    from support.postgres import postgres, postgres_available

    with postgres() as pg:                      # initdb in a temp dir, start on a free port
        url = pg.create_database("t1")          # postgresql+psycopg://postgres@127.0.0.1:PORT/t1
        ...
    # stopped (pg_ctl stop, then SIGKILL of the postmaster pid if needed), folder removed

    pg.stop()                                   # a restart in the middle of a test:
    pg.start()                                  # same port, same data

As root the cluster runs as the `postgres` user (initdb refuses root): the data folder is
chowned to it and every command goes through `runuser -u postgres`. Trust authentication,
`fsync=off` (a test cluster), listening on 127.0.0.1 only, socket in the temp folder.
`postgres_available()` says whether the binaries exist, so that a test can skip (with the
reason) on a machine without them; CI installs them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def pg_bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/<v>/bin holding initdb, or the one on PATH."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def postgres_available() -> bool:
    return pg_bin_dir() is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PostgresServer:
    port: int
    data_dir: Path
    bin_dir: Path
    as_user: list[str]
    #: The server options pg_ctl starts it with (set once it has started).
    options: str = ""

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _pg_ctl(self, *args: str) -> None:
        _run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args])

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`pg_ctl -m fast`: open connections are cut, committed data is
        on disk); `start()` brings it back on the same port."""
        self._pg_ctl("-m", mode, "-w", "-t", "60", "stop")

    def start(self) -> None:
        """Start the stopped server again, same port and data."""
        log = self.data_dir.parent / "log"
        self._pg_ctl("-l", str(log), "-w", "-t", "30", "-o", self.options, "start")

    def create_database(self, name: str) -> str:
        """Create an empty database (dropping one of that name) and return its URL."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )


@contextlib.contextmanager
def postgres() -> Iterator[PostgresServer]:
    """Start a PostgreSQL cluster on a free 127.0.0.1 port; stop it by its pid on exit."""
    bin_dir = pg_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL binaries not found (apt-get install postgresql)")
    tmp = Path(tempfile.mkdtemp(prefix="zerowatch-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data = tmp / "data"
    server = PostgresServer(port=0, data_dir=data, bin_dir=bin_dir, as_user=as_user)
    try:
        _run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
              "--auth=trust", "-E", "UTF8", "--no-locale"])  # fmt: skip
        for attempt in range(3):
            server.port = _free_port()
            server.options = (
                f"-c listen_addresses=127.0.0.1 -c port={server.port} "
                f"-c unix_socket_directories={tmp} -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=200"
            )
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    log = (
                        (tmp / "log").read_text(errors="replace")[-2000:]
                        if (tmp / "log").exists()
                        else ""
                    )
                    raise RuntimeError(f"PostgreSQL did not start:\n{log}") from None
        yield server
    finally:
        pid = server.pid()
        if pid is not None:
            subprocess.run(
                [
                    *as_user,
                    str(bin_dir / "pg_ctl"),
                    "-D",
                    str(data),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
                capture_output=True,
                timeout=60,
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["PostgresServer", "pg_bin_dir", "postgres", "postgres_available"]
