"""The ingest client over one keep-alive connection (http.client): it reuses the connection,
sends the token and the agent's headers, notices a connection the server closed while idle,
and turns what no answer came back for into ServerUnavailable."""

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
from zerowatch.agent.client import IngestClient, ServerUnavailable


class _Server:
    """HTTP/1.1 with keep-alive; `close_after` closes each connection after that many
    answers without saying so (as a server's idle timeout does); `delay_s` holds answers."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
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
                fake.requests.append((self.path, dict(self.headers), body))
                time.sleep(fake.delay_s)
                data = json.dumps({"accepted": 1, "duplicates": 0, "detail": "x"}).encode()
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

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.stop()


def test_posts_share_one_connection_and_carry_the_token_and_headers(server: _Server) -> None:
    client = IngestClient(server.url + "/", token="s3cret")
    body = gzip.compress(b'{"events":[]}')
    for _ in range(3):
        res = client.post_events("r1", body)
        assert (res.accepted, res.duplicates) == (1, 0)
    client.close()
    assert server.connections == 1
    path, headers, sent = server.requests[0]
    assert path == "/api/v1/runs/r1/events" and sent == body
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Content-Encoding"] == "gzip"
    assert headers["User-Agent"].startswith("zerowatch-agent/")


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
    client.close()
    assert server.requests[0][0] == "/zw/api/v1/runs"


def test_no_answer_in_time_is_server_unavailable(server: _Server) -> None:
    server.delay_s = 1.0
    client = IngestClient(server.url, timeout_s=0.2, attempts=1)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="timed out"):
        client.post_events("r1", b"x")
    assert time.monotonic() - t0 < 0.9
    client.close()


def test_a_refused_connection_is_server_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = IngestClient(f"http://127.0.0.1:{port}", attempts=1)
    with pytest.raises(ServerUnavailable):
        client.post_events("r1", b"x")


def test_retry_after_travels_with_a_503(server: _Server) -> None:
    server.status = 503
    server.extra_headers = {"Retry-After": "7"}
    client = IngestClient(server.url, attempts=1)
    with pytest.raises(ServerUnavailable) as err:
        client.post_events("r1", b"x")
    assert err.value.retry_after_s == 7.0
    assert "503" in str(err.value)
    client.close()


def test_a_server_behind_a_proxy_is_reached_through_httpx(
    monkeypatch: pytest.MonkeyPatch, server: _Server
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "")
    assert client_mod._proxied("http://zerowatch.example:8000")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert not client_mod._proxied(server.url)
    client = IngestClient(server.url)  # bypassed: direct
    assert isinstance(client._http, client_mod._Connection)
    client.post_events("r1", b"x")
    client.close()
