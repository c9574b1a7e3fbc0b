"""`zerowatch serve`'s edge on a real socket: a connection that sends nothing, its headers
a line at a time or its body a byte at a time is closed at its deadline; a Host that does
not name this machine is refused; an ordinary request is served as always."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from support.ports import free_port

HEAD_S, BODY_S = 1.0, 2.0
#: Longer than any deadline: a connection still open then was never closed.
GIVE_UP_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROWATCH_")}
    home = tmp_path_factory.mktemp("edge")
    env.update(ZEROWATCH_HEAD_TIMEOUT_S=str(HEAD_S), ZEROWATCH_BODY_TIMEOUT_S=str(BODY_S),
               ZEROWATCH_DB_URL=f"sqlite:///{home / 'z.db'}")  # fmt: skip
    # (cwd: not the repository's root, whose zerowatch/ folder is not the installed package)
    proc = subprocess.Popen([sys.executable, "-m", "zerowatch.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            cwd=home)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _closed_after(sock: socket.socket, trickle: bytes = b"", every_s: float = 0.2) -> float:
    """Seconds until the server closes `sock`, sending `trickle` every `every_s` meanwhile."""
    t0 = time.monotonic()
    sock.settimeout(every_s)
    while time.monotonic() - t0 < GIVE_UP_S:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        if trickle:
            try:
                sock.sendall(trickle)
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - t0
    pytest.fail(f"the connection was still open after {GIVE_UP_S} s")


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(server):
    with socket.create_connection(("127.0.0.1", server)) as s:
        took = _closed_after(s)
    print(f"\nidle connection closed after {took:.2f} s (deadline {HEAD_S} s)")
    assert took >= HEAD_S * 0.9


def test_headers_sent_a_line_at_a_time_are_closed_at_the_head_deadline(server):
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        took = _closed_after(s, trickle=b"X-Slow: 1\r\n")
    print(f"\nslow headers closed after {took:.2f} s (deadline {HEAD_S} s)")


def test_a_body_sent_a_byte_at_a_time_is_closed_at_the_body_deadline(server):
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"POST /api/v1/runs/legit/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")  # fmt: skip
        took = _closed_after(s, trickle=b" ")
    print(f"\nslow body closed after {took:.2f} s (deadline {BODY_S} s)")
    assert took >= BODY_S * 0.9


def test_the_machines_own_names_are_served_and_another_host_is_refused(server):
    url = f"http://127.0.0.1:{server}/healthz"
    assert httpx.get(url, timeout=5).status_code == 200
    assert (
        httpx.get(url, headers={"host": f"{socket.gethostname()}:{server}"}, timeout=5).status_code
        == 200
    )
    r = httpx.get(url, headers={"host": "evil.example"}, timeout=5)
    assert r.status_code == 400 and "Host" in r.json()["detail"]
    # A kept-alive connection between requests is not cut by the head deadline's first arm.
    with httpx.Client(timeout=5) as c:
        assert c.get(url).status_code == 200
        time.sleep(HEAD_S * 1.5)
        assert c.get(url).status_code == 200
