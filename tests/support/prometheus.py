"""A real, throwaway Prometheus for tests (Debian package `prometheus`).

Usage::

    from support.prometheus import prometheus

    with prometheus(targets=["http://127.0.0.1:8321/metrics"], rule_files=[rules_path]) as prom:
        prom.wait_for(lambda: prom.query('zerowatch_step_time_seconds'), timeout=15)
        samples = prom.query('zerowatch_step_time_seconds{run="abc"}')
        alerts = prom.alerts()

`prometheus(...)` writes a config into a temporary directory (scrape and evaluation every
second by default, one scrape job per target, the given rule files), starts
`prometheus --config.file ... --storage.tsdb.path ... --web.listen-address=127.0.0.1:<free
port>`, waits for `/-/ready`, and on exit stops that process by its pid (SIGTERM, then
SIGKILL) and removes the directory. A port taken between picking and binding is retried.

`query(expr)` returns the `result` list of an instant query (`/api/v1/query`); `alerts()`
the `alerts` list of `/api/v1/alerts` (each with `labels`, `annotations`, `state` pending or
firing, `value`); `rules()` the rule groups of `/api/v1/rules`; `targets()` the active
scrape targets. Errors (a bad expression, a Prometheus that died) raise `PrometheusError`
with Prometheus' own message and the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import yaml

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"

T = TypeVar("T")


class PrometheusError(RuntimeError):
    """Prometheus could not start, died, or answered an API call with an error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_configs(targets: Sequence[str], scrape_interval: str) -> list[dict[str, Any]]:
    """One job per target URL (`http://host:port/path`, or bare `host:port` for /metrics)."""
    jobs = []
    for i, target in enumerate(targets):
        parts = urlsplit(target if "://" in target else f"http://{target}")
        jobs.append(
            {
                "job_name": f"target{i}",
                "scheme": parts.scheme,
                "metrics_path": parts.path or "/metrics",
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "static_configs": [{"targets": [parts.netloc]}],
            }
        )
    return jobs


@dataclass
class PrometheusServer:
    """A running Prometheus: its base URL, process and log; the query helpers."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    config_path: Path
    _client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0))

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, n: int = 40) -> str:
        """The last `n` lines of Prometheus' own log (for error messages)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _get(self, path: str, **params: Any) -> Any:
        if self.process.poll() is not None:
            raise PrometheusError(
                f"prometheus (pid {self.pid}) exited with {self.process.returncode}:\n"
                + self.log_tail()
            )
        resp = self._client.get(f"{self.url}{path}", params=params)
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params}: {resp.status_code} {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the `result` list (`[{"metric": {...}, "value": [ts, "v"]}, ...]`)."""
        data = self._get("/api/v1/query", query=expr)
        result = data["result"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return list(result)

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing): `labels`, `annotations`, `state`, `value`."""
        return list(self._get("/api/v1/alerts")["alerts"])

    def rules(self) -> list[dict[str, Any]]:
        """The loaded rule groups, with each rule's health and last error."""
        return list(self._get("/api/v1/rules")["groups"])

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets, with `health` and `lastError`."""
        return list(self._get("/api/v1/targets")["activeTargets"])

    def wait_for(
        self, check: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.5
    ) -> T:
        """Call `check` until it returns something truthy; return that. On timeout raise
        `PrometheusError` with the last value, the scrape targets' state and the log tail."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            last = check()
            if last:
                return last
            if time.monotonic() > deadline:
                targets: list[Any]
                try:
                    targets = [
                        (t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets()
                    ]
                except Exception as e:  # the diagnosis must not hide the timeout
                    targets = [f"(targets unavailable: {e})"]
                raise PrometheusError(
                    f"timed out after {timeout}s; last value: {last!r}; targets: {targets}\n"
                    + self.log_tail()
                )
            time.sleep(interval)

    def stop(self) -> None:
        """Stop this Prometheus by its pid: SIGTERM, then SIGKILL after 10 s."""
        self._client.close()
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def _start(workdir: Path, config: dict[str, Any], ready_timeout: float) -> PrometheusServer:
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = _free_port()
    log_path = workdir / f"prometheus-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS_BIN,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = PrometheusServer(
        url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, config_path=config_path
    )
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PrometheusError(
                f"prometheus exited with {process.returncode} before ready:\n{server.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/-/ready", timeout=1.0).status_code == 200:
                return server
        time.sleep(0.1)
    server.stop()
    raise PrometheusError(f"prometheus not ready after {ready_timeout}s:\n{server.log_tail()}")


@contextlib.contextmanager
def prometheus(
    *,
    targets: Sequence[str] = (),
    rule_files: Sequence[str | os.PathLike[str]] = (),
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    ready_timeout: float = 30.0,
) -> Iterator[PrometheusServer]:
    """Start a real Prometheus on 127.0.0.1 and yield it; stop it by its pid on exit.

    Args:
        targets: URLs to scrape (`http://127.0.0.1:PORT/metrics`), one scrape job each.
        rule_files: recording/alerting rule files to load (absolute paths are safest).
        scrape_interval: how often every target is scraped.
        evaluation_interval: how often rules are evaluated.
        ready_timeout: seconds to wait for `/-/ready`.
    """
    if not Path(PROMETHEUS_BIN).exists():
        raise PrometheusError(
            f"{PROMETHEUS_BIN} not found: install the Debian package `prometheus`"
        )
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": _scrape_configs(targets, scrape_interval),
    }
    workdir = Path(tempfile.mkdtemp(prefix="zerowatch-prom-"))
    server: PrometheusServer | None = None
    try:
        for attempt in range(3):
            try:
                server = _start(workdir, config, ready_timeout)
                break
            except PrometheusError as e:
                # Another process may have taken the port between picking and binding.
                if "address already in use" not in str(e) or attempt == 2:
                    raise
        assert server is not None
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["PrometheusError", "PrometheusServer", "prometheus"]
