"""The ingest client against a real HTTP/1.1 server: one kept-alive connection carrying the
token and the agent's headers, a connection the server closed while idle opened again, the
server's path prefix kept, no answer in time or no server at all as ServerUnavailable, the
4xx answers sorted (413, 404 of a run, any other), 5xx and 429 with their Retry-After, and a
server the environment routes through a proxy reached through it."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from zerowatch.agent import client as client_mod
from zerowatch.agent.client import (
    IngestClient,
    PayloadTooLarge,
    RunNotFound,
    ServerRejected,
    ServerUnavailable,
)


class _Server:
    """HTTP/1.1 with keep-alive, answering `status` (with `extra_headers`) to every POST;
    `close_after` closes each connection after that many answers without saying so (as a
    server's idle timeout does); `delay_s` holds the answers."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes, float]] = []
        self.close_after: int | None = None
        self.delay_s = 0.0
        self.status = 200
        self.extra_headers: dict[str, str] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                fake.connections += 1
                self.answered = 0

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests.append((self.path, dict(self.headers), body, time.monotonic()))
                time.sleep(fake.delay_s)
                data = json.dumps({"accepted": 1, "duplicates": 0, "detail": "why"}).encode()
                self.send_response(fake.status)
                for k, v in fake.extra_headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.answered += 1
                if fake.close_after is not None and self.answered >= fake.close_after:
                    self.close_connection = True

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up on an answer (the timeout test)

        self._server = Quiet(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def test_posts_share_one_connection_and_carry_the_token_and_headers(server: _Server) -> None:
    client = IngestClient(server.url + "/", token="s3cret")
    body = gzip.compress(b'{"events":[]}')
    for _ in range(3):
        res = client.post_events("r1", body)
        assert (res.accepted, res.duplicates) == (1, 0)
    client.create_run(b"{}")
    client.close()
    assert server.connections == 1
    path, headers, sent, _ = server.requests[0]
    assert path == "/api/v1/runs/r1/events" and sent == body
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"].startswith("zerowatch-agent/")
    path, headers, sent, _ = server.requests[-1]
    # The run's creation is compressed as event batches are.
    assert path == "/api/v1/runs" and gzip.decompress(sent) == b"{}"
    assert headers["Content-Encoding"] == "gzip"
    assert headers["Authorization"] == "Bearer s3cret"


def test_no_token_sends_no_authorization(server: _Server) -> None:
    client = IngestClient(server.url)
    client.post_events("r1", b"x")
    client.close()
    assert "Authorization" not in server.requests[0][1]


def test_a_connection_the_server_closed_while_idle_is_opened_again(server: _Server) -> None:
    server.close_after = 1  # the server drops each connection after one answer, silently
    client = IngestClient(server.url, attempts=1)
    for _ in range(3):
        client.post_events("r1", b"x", retry=False)  # no retry: the first try must work
        time.sleep(0.05)
    client.close()
    assert server.connections == 3


def test_a_server_path_prefix_is_kept(server: _Server) -> None:
    client = IngestClient(server.url + "/zw")
    client.create_run(b"{}")
    client.post_events("r1", b"x")
    client.close()
    assert [r[0] for r in server.requests] == ["/zw/api/v1/runs", "/zw/api/v1/runs/r1/events"]


def test_no_answer_in_time_is_server_unavailable(server: _Server) -> None:
    server.delay_s = 1.0
    client = IngestClient(server.url, timeout_s=0.2, attempts=1)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="timed out"):
        client.post_events("r1", b"x")
    assert time.monotonic() - t0 < 0.9
    client.close()


def test_past_the_close_deadline_nothing_is_sent(server: _Server) -> None:
    client = IngestClient(server.url)
    client.deadline = time.monotonic() - 0.1
    with pytest.raises(ServerUnavailable, match="out of time"):
        client.post_events("r1", b"x")
    assert server.requests == []


def test_a_refused_connection_is_server_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = IngestClient(f"http://127.0.0.1:{port}", attempts=1)
    with pytest.raises(ServerUnavailable):
        client.post_events("r1", b"x")


@pytest.mark.parametrize("status", [500, 503, 429])
def test_5xx_and_429_are_tried_again_and_carry_retry_after(server: _Server, status: int) -> None:
    server.status = status
    server.extra_headers = {"Retry-After": "0.1"}
    client = IngestClient(server.url, attempts=2)
    with pytest.raises(ServerUnavailable) as err:
        client.post_events("r1", b"x")
    assert err.value.retry_after_s == 0.1 and str(status) in str(err.value)
    assert "why" in str(err.value)  # the server's detail
    # Tried twice, the second time no earlier than the server asked.
    assert len(server.requests) == 2
    assert server.requests[1][3] - server.requests[0][3] >= 0.1
    client.close()


def test_a_long_retry_after_is_not_waited_in(server: _Server) -> None:
    server.status = 503
    server.extra_headers = {"Retry-After": "30"}
    client = IngestClient(server.url, attempts=3, max_wait_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable) as err:
        client.post_events("r1", b"x")
    assert time.monotonic() - t0 < 1.0 and len(server.requests) == 1
    assert err.value.retry_after_s == 30.0
    client.close()


@pytest.mark.parametrize(
    ("status", "error"),
    [(413, PayloadTooLarge), (404, RunNotFound), (401, ServerRejected), (422, ServerRejected)],
)
def test_4xx_answers_are_not_tried_again(server: _Server, status: int, error: type) -> None:
    server.status = status
    client = IngestClient(server.url, attempts=3)
    with pytest.raises(error) as err:
        client.post_events("r1", b"x")
    assert len(server.requests) == 1
    if isinstance(err.value, ServerRejected):
        assert (err.value.status, err.value.detail) == (status, "why")
    client.close()


def test_a_server_behind_a_proxy_is_reached_through_it(
    monkeypatch: pytest.MonkeyPatch, server: _Server
) -> None:
    # The test server plays the proxy: a proxied request carries the whole URL.
    monkeypatch.setenv("HTTP_PROXY", server.url)
    assert client_mod._proxy_for("http://zerowatch.example:8000") == server.url
    client = IngestClient("http://zerowatch.example:8000/zw", token="t")
    client.post_events("r1", b"x")
    client.close()
    path, headers, _, _ = server.requests[0]
    assert path == "http://zerowatch.example:8000/zw/api/v1/runs/r1/events"
    assert headers["Authorization"] == "Bearer t"
    monkeypatch.setenv("NO_PROXY", "zerowatch.example")
    assert client_mod._proxy_for("http://zerowatch.example:8000") is None
