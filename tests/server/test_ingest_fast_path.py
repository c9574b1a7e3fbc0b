"""The events door (server/ingest_path.py) answers every events POST in front of FastAPI,
valid or not, as the FastAPI route (its thin adapter) answers it; the one decoder's fast
pass (msgspec) reads a body as its careful pass does, or leaves it to that pass."""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import Iterator
from typing import Any

import msgspec
import orjson
import pytest
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from zerowatch.server import ingest_path
from zerowatch.server.app import create_app
from zerowatch.server.decode import careful_batch
from zerowatch.server.decode import fast_batch as decode_batch
from zerowatch.server.ingest_path import IngestFastPath
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2)
TOKEN = "s3cret"


@pytest.fixture
def routed(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, list[str]]]:
    """A client of an app with a token, and the paths the FastAPI app behind the fast path
    was asked to answer."""
    seen: list[str] = []
    app = create_app(Settings(db_url=sqlite_url, token=TOKEN, max_batch_bytes=200_000))
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with TestClient(app, headers=headers) as c:
        layer = app.ingest_fast_path  # type: ignore[attr-defined]
        assert isinstance(layer, IngestFastPath)
        inner = layer.app

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope.get("path", ""))
            await inner(scope, receive, send)

        monkeypatch.setattr(layer, "app", counted)
        rc = simulate.run_create(SPEC, run_id="fast")
        assert c.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
        seen.clear()
        yield c, seen


def _body(events: list[ev.StepEvent], run_id: str = "fast") -> bytes:
    return orjson.dumps(dataclasses.asdict(ev.EventBatch(run_id, events)))  # type: ignore[arg-type]


def test_a_valid_batch_is_stored_without_the_route(routed: tuple[TestClient, list[str]]) -> None:
    c, seen = routed
    events = [simulate.step_event(SPEC, r, s) for r in range(2) for s in range(3)]
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    r = c.post("/api/v1/runs/fast/events", content=gzip.compress(_body(events)), headers=headers)
    assert r.status_code == 200 and r.json() == {"accepted": 6, "duplicates": 0}
    assert r.headers["x-content-type-options"] == "nosniff"  # the app's headers still apply
    r = c.post("/api/v1/runs/fast/events", content=_body(events[:2]))  # a replay
    assert r.json() == {"accepted": 0, "duplicates": 2}
    assert seen == []
    ranks = c.get("/api/v1/runs/fast/ranks").json()["ranks"]
    assert [x["steps"] for x in ranks] == [3, 3]


@pytest.mark.parametrize("door", ["edge", "route"])
def test_every_answer_is_the_doors_own_and_the_routes_alike(
    routed: tuple[TestClient, list[str]], monkeypatch: pytest.MonkeyPatch, door: str
) -> None:
    """What is not stored is answered by the door itself (the FastAPI app behind it is not
    asked), with the status and words of the route; the route, reached when the edge
    leaves the request (an app without it), answers alike through the same functions."""
    c, seen = routed
    if door == "route":
        monkeypatch.setattr(ingest_path, "PREFIX", "/not/this/one/")
    good = _body([simulate.step_event(SPEC, 0, 0)])
    bad_rank = _body([simulate.step_event(dataclasses.replace(SPEC, world_size=9), 7, 0)])
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"content": good, "headers": {"Authorization": ""}}, 401, "token"),
        ({"content": good, "headers": {"Authorization": "Bearer nope"}}, 403, "wrong token"),
        ({"content": b'{"run_id": "fast", "events": [{"kind": "step"}]}'}, 422, "rank"),
        ({"content": b'{"run_id": NaN}'}, 422, "NaN"),
        ({"content": good, "headers": {"Content-Type": "text/plain"}}, 422, ""),
        ({"content": good, "headers": {"Content-Type": ""}}, 422, ""),
        ({"content": good, "headers": {"Content-Encoding": "gzip"}}, 400, "gzip"),
        ({"content": good, "headers": {"Content-Encoding": "br"}}, 415, "br"),
        ({"content": b"x" * 200_001}, 413, "max_batch_bytes"),
        ({"content": bad_rank}, 422, "world_size"),
    ]
    expected = [] if door == "edge" else ["/api/v1/runs/fast/events"]
    for kwargs, status, says in cases:
        seen.clear()
        r = c.post("/api/v1/runs/fast/events", **kwargs)
        assert r.status_code == status, (kwargs.get("headers"), r.text)
        assert says in r.text
        assert r.headers["x-frame-options"] == "DENY"
        assert seen == expected, (kwargs.get("headers"), seen, status)
    seen.clear()
    r = c.post("/api/v1/runs/nope/events", content=_body([simulate.step_event(SPEC, 0, 0)], "nope"))
    assert r.status_code == 404 and "nope" in r.text
    assert seen == [p.replace("fast", "nope") for p in expected]
    ranks = c.get("/api/v1/runs/fast/ranks").json()["ranks"]
    assert sum(x["steps"] for x in ranks) == 0  # nothing of the refused batches was stored
    r = c.post("/api/v1/runs/fast/events", content=good)
    assert r.status_code == 200 and r.json() == {"accepted": 1, "duplicates": 0}


def _route_decode(raw: bytes) -> ev.EventBatch | None:
    """What the decoder's careful pass (strict JSON, then pydantic's validation of the
    parsed objects, as FastAPI validates a route's body) makes of a body; None when it
    refuses it."""
    try:
        return careful_batch(raw)
    except (HTTPException, RequestValidationError):
        return None


def _values(obj: Any) -> Any:
    """A batch as plain values, field by field (read as attributes, defaults included): the
    fast path's events are msgspec Structs with the dataclasses' fields, the route's the
    dataclasses."""
    if isinstance(obj, msgspec.Struct):
        return {f.name: _values(getattr(obj, f.name)) for f in msgspec.structs.fields(obj)}
    if dataclasses.is_dataclass(obj):
        return {f.name: _values(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_values(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _values(v) for k, v in obj.items()}
    return obj


#: (JSON text of one step's fields after rank/seq/step/time, what it probes): types at the
#: edges of what each decoder reads, numbers at the edges of what the store holds, strings
#: the database cannot hold.
_EDGES = [
    ('"step_time_s": 1', "an int for a float"),
    ('"step_time_s": 1.0, "samples": 1.0', "a float for an int"),
    ('"step_time_s": 1.0, "samples": true', "a bool for an int"),
    ('"step_time_s": 1.0, "clipped": 1', "an int for a bool"),
    ('"step_time_s": "1.0"', "a string for a float"),
    ('"step_time_s": 1e999', "a float that overflows"),
    ('"step_time_s": -1e999', "a negative float that overflows"),
    ('"step_time_s": NaN', "NaN"),
    ('"step_time_s": Infinity', "Infinity"),
    ('"step_time_s": 1.0, "samples": 9223372036854775807', "int64's largest"),
    ('"step_time_s": 1.0, "samples": 9223372036854775808', "one past int64"),
    ('"step_time_s": 1.0, "samples": 18446744073709551616', "one past uint64"),
    ('"step_time_s": 1.0, "samples": -9223372036854775809', "one below int64"),
    ('"step_time_s": 100000000000000000000', "a 21-digit int for a float"),
    ('"step_time_s": 0.1234567890123456789012', "a 22-digit mantissa"),
    ('"step_time_s": 0.0004186889117305184', "a float below 0.01 at full precision"),
    ('"step_time_s": 1.0, "samples": -1234567890123456789012', "a long negative int"),
    ('"step_time_s": 1e-0000000000000000000001', "a long exponent"),
    ('"step_time_s": 1E-5, "exposed_comm_s": -0.0', "exponent forms, negative zero"),
    ('"step_time_s": 1.0, "host": "a\\u0000b"', "NUL in a string"),
    ('"step_time_s": 1.0, "host": "a\\\\u0000b"', "an escaped backslash before u0000"),
    ('"step_time_s": 1.0, "host": "a\\ud800b"', "a lone high surrogate"),
    ('"step_time_s": 1.0, "host": "a\\udc00b"', "a lone low surrogate"),
    ('"step_time_s": 1.0, "host": "a\\ud83d\\ude00b\\u00e9"', "a surrogate pair, an escape"),
    ('"step_time_s": 1.0, "host": "a\tb"', "a raw control character in a string"),
    ('"step_time_s": 1.0, "zzz": [1, {"x": 2}]', "an unknown field"),
    ('"step_time_s": 1.0, "step_time_s": 2.0', "a duplicated key"),
    ('"step_time_s": 1.0, "memory": null, "spans": null, "grad_norm": null', "nulls"),
    ('"step_time_s": 1.0, "memory": {"reserved_bytes": 1.5}', "a float inside memory"),
    ('"step_time_s": 1.0, "memory": {"peak_by_phase": {"forward": 3}}', "nested memory"),
    ('"step_time_s": 1.0, "kind": "end", "status": "finished"', "an end event"),
    ('"step_time_s": 1.0, "kind": "step"', "the kind"),
    ('"step_time_s": 1.0, "phases": {"forward": 1}', "an int in a dict of floats"),
    ('"step_time_s": 1.0, "phases": {"forward": "x"}', "a string in a dict of floats"),
    ('"step_time_s": 1.0, "collectives": [{"op": "all_gather"}]', "an incomplete record"),
    ('"step_time_s": 1.0, "collectives": [{"op": "gather", "purpose": "other", "count": 1, '
     '"bytes": 1, "latency_sum_s": 1, "latency_max_s": 1, "buckets": [1], "world_size": 2}]',
     "an op outside the vocabulary"),
    ('"step_time_s": 1.0, "spans": [{"name": "a", "cat": "phase", "start": 0, "end": 1, '
     '"args": {"n": 123456789012345678901234}}]', "a big integer in free-form args"),
    ('"step_time_s": 1.0, "spans": [{"name": "a", "cat": "phase", "start": 0, "end": 1, '
     '"args": {"n": 1e400}}]', "an overflowing float in free-form args"),
    ('"step_time_s": 1.0, "spans": [{"name": "a", "cat": "phase", "start": 0, "end": 1, '
     '"args": {"n": [1, 2.5, null, true, "s", {"k": -3}]}}]', "free-form args"),
]  # fmt: skip


def test_the_fast_decoder_reads_a_body_as_the_route_does_or_leaves_it() -> None:
    """decode_batch accepts only what the route accepts, with equal values: over the
    simulator's events (phases, collectives, memory, spans) and every edge above, alone
    and inside a body of valid events; the typical body is its own (not left to the route)."""
    spec = simulate.SimSpec(world_size=8, stage=3, spans_every=2)
    events = [simulate.step_event(spec, r, s) for r in range(3) for s in range(4)]
    raw = _body(events)
    fast = decode_batch(raw)
    assert fast is not None and _values(fast) == _values(_route_decode(raw))
    assert any(e.spans for e in fast.events) and all(e.memory for e in fast.events)
    taken = 0
    for text, probes in _EDGES:
        one = f'{{"rank": 0, "seq": 0, "step": 0, "time": 1.0, {text}}}'
        mixed = raw[: raw.rindex(b"]")] + b", " + one.encode() + raw[raw.rindex(b"]") :]
        for body in (f'{{"run_id": "fast", "events": [{one}]}}'.encode(), mixed):
            route, fast = _route_decode(body), decode_batch(body)
            assert fast is None or _values(fast) == _values(route), probes
            taken += fast is not None
    assert taken >= 20  # most edges are the fast decoder's own, not all left to the route
    for junk in (b"", b"[]", b"{", b'{"run_id": 1, "events": []}', b"\xff\xfe", b"null",
                 b'{"run_id": "fast"}', b'{"run_id": "fast", "events": {}}'):  # fmt: skip
        assert decode_batch(junk) is None and _route_decode(junk) is None, junk


def test_the_edge_admits_a_batch_once_and_sheds_past_the_bound(
    routed: tuple[TestClient, list[str]],
) -> None:
    """The door sits in front of the app's middleware: it does admission itself (503 +
    Retry-After past the bound, with the app's security headers), a request without the
    right token is answered before it takes a slot, and what the door leaves to the app (a
    URL with a NUL) is not counted a second time by the admission middleware."""
    c, seen = routed
    admission = c.app.state.admission  # type: ignore[attr-defined]
    body = _body([simulate.step_event(SPEC, 0, 0)])
    while admission.try_admit() is None:  # fill every slot
        pass
    held, shed = admission.pending, admission.shed
    r = c.post("/api/v1/runs/fast/events", content=body)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-frame-options"] == "DENY"
    assert (admission.pending, admission.shed) == (held, shed + 1)
    for _ in range(held):
        admission.release()
    r = c.post("/api/v1/runs/fast/events", content=body)
    assert r.status_code == 200 and r.json() == {"accepted": 1, "duplicates": 0}
    assert r.headers["content-type"] == "application/json" and seen == []
    r = c.post("/api/v1/runs/fast/events", content=body, headers={"Authorization": "Bearer x"})
    assert r.status_code == 403 and seen == []  # the door's answer, before admission
    r = c.post("/api/v1/runs/fast/events%00", content=body)
    assert r.status_code == 400
    assert admission.pending == 0  # each admitted once, released once


def test_small_floats_at_full_precision_take_the_fast_path() -> None:
    """The shortest text of a float below 0.01 has a fraction of 19 digits or more (a real
    run's latencies): such a body is the fast decoder's, with the route's values; an integer
    of 19 digits is still left to the route."""
    spec = simulate.SimSpec(world_size=8, stage=3)
    events = [simulate.step_event(spec, 0, s) for s in range(2)]
    for e in events:
        e.step_time_s, e.exposed_comm_s = 0.0004186889117305184, 0.000012345678901234568
    raw = _body(events)
    assert b"0.0004186889117305184" in raw and b"0.000012345678901234568" in raw
    fast = decode_batch(raw)
    assert fast is not None and _values(fast) == _values(_route_decode(raw))
    assert decode_batch(raw.replace(b"0.0004186889117305184", b"1234567890123456789")) is None
