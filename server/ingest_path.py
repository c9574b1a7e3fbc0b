"""The ingest route's fast path: a well-formed batch stored without FastAPI's routing.

Every agent POSTs its batches to `/api/v1/runs/{run_id}/events`: 256 requests a second
from a 4,096-rank job. Through FastAPI a request walks the router's routes, solves the
route's dependencies (path parameter, bearer credentials, body) and builds its response:
about 0.4 ms of CPU per POST (half of the event loop's time per POST of 16 steps, measured
in-process), for work the batch itself does not need. `IngestFastPath` answers what an
agent sends almost always, a batch that is valid and is stored, with the same steps the route
takes: the token check (deps.check_token's rules), the body (size limit, gzip), parsing
and validation into `events.EventBatch`, the ingest writer, and the route's answer.

Parsing and validation are one pass of msgspec over the body (`decode_batch`): the route's
two passes (strict JSON: body.py, then pydantic's validation of the parsed objects) cost ~19
µs per rank-step, msgspec ~7. A step event and its collectives records are decoded into
msgspec Structs made from the events' dataclasses (`_mirror`: the same fields, types and
defaults), which msgspec builds in two thirds of a dataclass's time (8.1 against 11.4 µs a
rank-step, in-process); the writer reads events by attribute only (store.py), so either
kind serves it. The smaller records (memory, offload, spans) stay the dataclasses the
store serialises. msgspec is stricter than pydantic's lax mode (it refuses `1.0` for an
int, `1` for a bool), never laxer, so a body it decodes is one the route accepts, with the
same values; the JSON the route refuses that msgspec would read is screened first (a NUL
in a string, a run of 19 digits: an integer that may not fit 64 bits). Anything msgspec
refuses, or a batch that holds an end event (one per rank per run), takes the route's
path, which says what is wrong in its own words. tests/server/test_ingest_fast_path.py holds the two decoders to the
same answer over valid, edge and invalid bodies.

Anything else falls through to the FastAPI route with the request exactly as it came (the
body read so far is replayed): a missing or wrong token, a body that is too large, not
gzip, not JSON or not valid, an unknown run, a batch the store refuses, a database error.
The route then answers as it always did, with its own status codes and messages, so
there is one definition of every error. Storing is idempotent on (run, rank, seq), so a
batch that reached the writer before falling through is not stored twice.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import secrets
import types
import typing
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
from zerowatch.server import store
from zerowatch.server.admission import ADMITTED, admitted
from zerowatch.server.body import gunzip, may_hold_long_int
from zerowatch.server.security import HEADERS

from zerowatch import events as ev

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PREFIX = "/api/v1/runs/"
SUFFIX = "/events"


def _mirror(cls: type, hot: dict[type, Any]) -> Any:
    """A msgspec Struct with the fields, types and defaults of the events dataclass `cls`;
    the dataclasses it refers to that are keys of `hot` become their Structs too (built
    here, once, into `hot`)."""

    def typ(t: Any) -> Any:
        if t in hot:
            return hot[t] if hot[t] is not None else _mirror(t, hot)
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is None or origin is typing.Literal:
            return t
        inner = tuple(typ(a) for a in args)
        if origin in (typing.Union, types.UnionType):
            return functools.reduce(operator.or_, inner)
        return origin[inner] if len(inner) > 1 else origin[inner[0]]

    hints = typing.get_type_hints(cls)
    fields: list[Any] = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, typ(hints[f.name]), f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append(
                (f.name, typ(hints[f.name]), msgspec.field(default_factory=f.default_factory))
            )
        else:
            fields.append((f.name, typ(hints[f.name])))
    hot[cls] = msgspec.defstruct(cls.__name__, fields, kw_only=True, module=__name__)
    return hot[cls]


_StepEvent = _mirror(ev.StepEvent, {ev.StepEvent: None, ev.CollectiveStats: None})


class _StepBatch(msgspec.Struct, kw_only=True):
    """EventBatch with step events only: msgspec decodes a union of one type."""

    run_id: str
    events: list[_StepEvent]  # type: ignore[valid-type]
    schema_version: int = ev.SCHEMA_VERSION


_DECODER = msgspec.json.Decoder(_StepBatch)


def decode_batch(raw: bytes) -> ev.EventBatch | None:
    """The batch of a JSON body of step events, as the route would validate it (its events
    the Structs of `_mirror`); None when the body is the route's to judge (see the module
    docstring)."""
    # (A backslash is rare in an agent's JSON: one memchr before the search for \\u0000.)
    if (b"\\" in raw and b"\\u0000" in raw) or may_hold_long_int(raw):
        return None
    try:
        b = _DECODER.decode(raw)
    except msgspec.MsgspecError:
        return None
    return ev.EventBatch(b.run_id, b.events, b.schema_version)  # type: ignore[arg-type]


class _FallThrough(Exception):
    """The request is not the fast path's: hand it to the route."""


class IngestFastPath:
    """The app's edge for agents' event batches (see the module docstring).

    It sits in front of the whole FastAPI app (`app`: its middleware and routes, which
    answer everything else and whatever the fast path leaves), not among its middleware: a
    request that walks the ASGI layers (the app, its error handling, body limit and
    telemetry, the read gate, the security headers, admission, the URL check) pays each
    layer again every time its task resumes (the body, the writer's answer) and for every
    message it sends, ~5 us a rank-step at 16 steps a POST. So the edge does itself what
    those layers do to such a request: admission (`admission.admitted`, marking the request
    so the middleware does not count it twice), the security headers on its answer, and
    leaves a URL holding a NUL to the app. `state` is the app's (settings, ingestor and
    admission are read at each request)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not path.startswith(PREFIX)
            or not path.endswith(SUFFIX)
            or "\x00" in path
            or b"%00" in scope.get("raw_path", b"")
            or b"%00" in scope.get("query_string", b"")
        ):
            await self.app(scope, receive, send)
            return
        scope[ADMITTED] = True
        await admitted(self.state.admission, self._store, scope, receive, send, HEADERS)

    async def _store(self, scope: Message, receive: Receive, send: Send) -> None:
        path = scope["path"]
        run_id = path[len(PREFIX) : -len(SUFFIX)]
        state = self.state
        read: list[Message] = []
        try:
            if not run_id or "/" in run_id or len(run_id) > store.MAX_RUN_ID_CHARS:
                raise _FallThrough
            headers = {k.lower(): v for k, v in scope.get("headers", ())}
            if not _is_json(headers.get(b"content-type")):
                raise _FallThrough  # FastAPI validates such a body as bytes
            _check_token(state.settings.token, headers.get(b"authorization"))
            limit = int(state.settings.max_batch_bytes)
            raw = await _read_body(receive, read, limit)
            encoding = headers.get(b"content-encoding", b"identity").strip().lower()
            if encoding == b"gzip" and raw:
                raw = gunzip(raw, limit)
            elif encoding not in (b"identity", b""):
                raise _FallThrough
            batch = decode_batch(raw)
            if batch is None:
                raise _FallThrough
            result = await state.ingestor.submit_async(run_id=run_id, batch=batch)
            if result is None:  # unknown run: the route's 404
                raise _FallThrough
        except Exception:  # not the happy path (see the module docstring): the route's turn
            await self.app(scope, _replay(read, receive), send)
            return
        body = b'{"accepted":%d,"duplicates":%d}' % (result.accepted, result.duplicates)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-length", b"%d" % len(body)),
                    (b"content-type", b"application/json"),
                    *HEADERS,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _is_json(content_type: bytes | None) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON: application/json or
    application/*+json. A body without one is the route's to judge (FastAPI's
    strict_content_type: refused by default)."""
    if not content_type:
        return False
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (
        kind.startswith(b"application/") and kind.endswith(b"+json")
    )


def _check_token(token: str | None, authorization: bytes | None) -> None:
    """Pass when no token is configured or the request carries it (deps.check_token)."""
    if token is None:
        return
    if authorization is None:
        raise _FallThrough
    scheme, _, credentials = authorization.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not credentials:
        raise _FallThrough
    if not secrets.compare_digest(credentials.encode(), token.encode()):
        raise _FallThrough


async def _read_body(receive: Receive, read: list[Message], limit: int) -> bytes:
    """The whole body; the messages read are kept in `read` for a fall-through."""
    chunks, size = [], 0
    while True:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            raise _FallThrough  # the client went away: the route sees it too
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _FallThrough  # the route answers 413
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """A receive that gives the messages already read again, then the rest of the stream."""
    pending = list(read)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again


__all__ = ["IngestFastPath", "decode_batch"]
