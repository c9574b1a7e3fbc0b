"""What a hostile or broken client sends to ingest gets one answer, whichever way it comes
in: a header that decides the request, sent twice, is refused naming it; a request without
the token is answered before its body is read and holds no ingest slot while the body
trickles in; a gzip body is one whole gzip member and nothing after it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from support.live_server import LiveServer
from support.server_api import asdict, batch_body, gz
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2)
TOKEN = "s3cret"
OK = ("authorization", f"Bearer {TOKEN}")
JSON = ("content-type", "application/json")
GZIP = ("content-encoding", "gzip")


@pytest.fixture
def guarded(sqlite_url: str) -> Iterator[TestClient]:
    """An app with a token, a run "h" created, and a client that sends no header of its own."""
    with TestClient(create_app(Settings(db_url=sqlite_url, token=TOKEN))) as c:
        rc = asdict(simulate.run_create(SPEC, run_id="h"))
        assert c.post("/api/v1/runs", json=rc, headers=[OK]).status_code == 201
        yield c


def _stored(c: TestClient) -> int:
    return sum(x["steps"] for x in c.get("/api/v1/runs/h/ranks").json()["ranks"])


def test_a_header_sent_twice_is_refused_naming_it(guarded: TestClient) -> None:
    """Two Authorization (or Content-Type, Content-Encoding) headers are not read one way
    by one layer and the other way by the next: the request is a 400 naming the header,
    whichever comes first, on ingest, run creation, heartbeats and delete alike."""
    c = guarded
    body = gz(batch_body("h", [simulate.step_event(SPEC, 0, 0)]))
    events = "/api/v1/runs/h/events"
    nope = ("authorization", "Bearer nope")
    cases = [
        ([nope, OK, JSON, GZIP], "Authorization"),
        ([OK, nope, JSON, GZIP], "Authorization"),
        ([OK, OK, JSON, GZIP], "Authorization"),
        ([OK, JSON, ("content-type", "text/plain"), GZIP], "Content-Type"),
        ([OK, JSON, GZIP, ("content-encoding", "identity")], "Content-Encoding"),
    ]
    for headers, name in cases:
        r = c.post(events, content=body, headers=headers)
        assert r.status_code == 400, (headers, r.text)
        assert name in r.json()["detail"], r.text
        assert r.headers["x-frame-options"] == "DENY"
    assert _stored(c) == 0
    rc = asdict(simulate.run_create(SPEC, run_id="h2"))
    r = c.post("/api/v1/runs", json=rc, headers=[nope, OK])
    assert r.status_code == 400 and "Authorization" in r.text
    beat = {"run_id": "h", "heartbeats": []}
    r = c.post("/api/v1/runs/h/heartbeats", json=beat, headers=[OK, nope])
    assert r.status_code == 400 and "Authorization" in r.text
    r = c.delete("/api/v1/runs/h", headers=[nope, OK])
    assert r.status_code == 400 and "Authorization" in r.text
    r = c.post("/api/v1/runs", content=gz(rc), headers=[OK, JSON, GZIP, GZIP])
    assert r.status_code == 400 and "Content-Encoding" in r.text
    assert c.get("/api/v1/runs/h2").status_code == 404  # nothing of it was created
    assert c.post(events, content=body, headers=[OK, JSON, GZIP]).json()["accepted"] == 1


def test_reads_that_need_the_token_refuse_it_twice(sqlite_url: str) -> None:
    settings = Settings(db_url=sqlite_url, token=TOKEN, read_requires_token=True)
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/v1/runs", headers=[OK]).status_code == 200
        for path in ("/api/v1/runs", "/metrics"):
            r = c.get(path, headers=[("authorization", "Bearer nope"), OK])
            assert r.status_code == 400 and "Authorization" in r.text, path


def test_a_gzip_body_is_one_member_and_nothing_after_it(guarded: TestClient) -> None:
    """Bytes after the first gzip member (a second member, or junk) make the body invalid
    gzip (400), as docs/server.md says; nothing of it is stored."""
    c = guarded
    member = gz(batch_body("h", [simulate.step_event(SPEC, 0, 0)]))
    second = gz(batch_body("h", [simulate.step_event(SPEC, 1, 0)]))
    for body in (member + second, member + b"junk", member + b"\x00"):
        r = c.post("/api/v1/runs/h/events", content=body, headers=[OK, JSON, GZIP])
        assert r.status_code == 400 and "gzip" in r.json()["detail"], r.text
    rc = gz(asdict(simulate.run_create(SPEC, run_id="h3")))
    r = c.post("/api/v1/runs", content=rc + b"junk", headers=[OK, JSON, GZIP])
    assert r.status_code == 400 and "gzip" in r.text
    assert _stored(c) == 0
    r = c.post("/api/v1/runs/h/events", content=member, headers=[OK, JSON, GZIP])
    assert r.json() == {"accepted": 1, "duplicates": 0}


def _slow_sender(port: int, path: str, token: str | None) -> socket.socket:
    """A connection that sends a POST's headers and the first bytes of its body, then waits."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: 100000\r\n\r\n{{".encode()
    )
    return s


def test_slow_senders_without_the_token_do_not_lock_agents_out() -> None:
    """More unauthenticated requests than the ingest bound, their bodies trickling in, take
    no slot: each is answered 401/403 from its headers, and an agent's POSTs (run creation
    and events) are stored, not turned away with 503."""
    limit = 4
    with LiveServer(token=TOKEN, settings={"ingest_max_pending": limit}) as server:
        paths = ["/api/v1/runs/h/events", "/api/v1/runs"]
        slow = [
            _slow_sender(server.port, paths[i % 2], None if i % 3 else "nope")
            for i in range(3 * limit)
        ]
        try:
            time.sleep(0.5)  # the server has read every slow request's headers
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=10) as c:
                rc = asdict(simulate.run_create(SPEC, run_id="h"))
                r = c.post("/api/v1/runs", json=rc)
                assert r.status_code == 201, r.text
                body = gz(batch_body("h", [simulate.step_event(SPEC, 0, 0)]))
                r = c.post("/api/v1/runs/h/events", content=body, headers=dict([JSON, GZIP]))
                assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
            for s in slow:  # answered from the headers alone, the body still unsent
                head = s.recv(200)
                assert head.startswith((b"HTTP/1.1 401", b"HTTP/1.1 403")), head
        finally:
            for s in slow:
                s.close()


def test_a_heartbeat_without_the_token_is_answered_from_its_headers() -> None:
    """The heartbeats route holds no ingest slot, but its body was read before the token was
    checked: a slow unauthenticated sender held its connection until the body deadline."""
    with LiveServer(token=TOKEN) as server:
        s = _slow_sender(server.port, "/api/v1/runs/h/heartbeats", None)
        try:
            head = s.recv(200)  # the body is still unsent
            assert head.startswith(b"HTTP/1.1 401"), head
        finally:
            s.close()
