"""Admission of what agents POST (their runs and event batches): past the bound a request is
turned away with 503 + Retry-After
before its body is read, the crowd turned away is handed slots spread at the server's
answer rate, and nothing but ingest is ever turned away."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from zerowatch.server import admission as admission_module
from zerowatch.server.admission import Admission, AdmissionMiddleware


def call(mw: AdmissionMiddleware, method: str, path: str) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path}
    # A loop of its own on a thread of its own: the suite's earlier tests may leave one
    # running on this thread (asyncio.run refuses to start inside it).
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, mw(scope, receive, send)).result()
    return sent


def test_past_the_bound_ingest_gets_503_with_retry_after_and_its_body_unread() -> None:
    admission = Admission(1)
    assert admission.try_admit() is None  # one request in hand: the bound

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = AdmissionMiddleware(app, admission)
    start, body = call(mw, "POST", "/api/v1/runs/r1/events")
    headers = dict(start["headers"])
    assert start["status"] == 503 and int(headers[b"retry-after"]) >= 1
    assert "ingest_max_pending" in json.loads(body["body"])["detail"]
    assert call(mw, "POST", "/api/v1/runs")[0]["status"] == 503  # agents' RunCreate too
    # Reads and everything else pass while ingest is full.
    for method, path in (("GET", "/metrics"), ("GET", "/runs/r1"), ("DELETE", "/api/v1/runs/r1"),
                         ("GET", "/api/v1/runs/r1/series")):  # fmt: skip
        assert call(mw, method, path)[0]["status"] == 200
    admission.release()
    assert call(mw, "POST", "/api/v1/runs/r1/events")[0]["status"] == 200
    assert admission.pending == 0 and admission.shed == 2


def test_a_crowd_turned_away_together_gets_slots_spread_at_the_answer_rate() -> None:
    admission = Admission(1)
    admission.try_admit()
    waits = [admission.try_admit() for _ in range(200)]
    assert all(w is not None for w in waits)
    assert waits == sorted(waits)  # later arrivals are sent later
    # 200 slots at the assumed 20 answers a second: the last comes back ~10 s after the first.
    assert waits[0] == 1 and 10 <= waits[-1] - waits[0] <= 11


def test_slow_answers_lower_the_limit_and_fast_ones_raise_it_again(monkeypatch) -> None:
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    admission = Admission(64)
    for _ in range(100):  # a server whose answers take 5 s, one every 2 s
        assert admission.try_admit() is None
        clock.now += 2.0
        admission.release(latency_s=5.0)
    assert admission.limit == 4  # the floor
    assert [admission.try_admit() is None for _ in range(5)] == [True] * 4 + [False]
    for _ in range(4):
        admission.release(latency_s=0.05)
    for _ in range(100):  # fast answers again: back up to the configured bound
        admission.try_admit()
        admission.release(latency_s=0.05)
    assert admission.limit == 64


def test_slow_answers_never_raise_a_bound_set_below_the_floor(monkeypatch) -> None:
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    admission = Admission(2)
    for _ in range(10):
        assert admission.try_admit() is None
        clock.now += 2.0
        admission.release(latency_s=5.0)
    assert admission.limit == 2
    assert [admission.try_admit() is None for _ in range(3)] == [True, True, False]
