"""Request bodies: size limit, gzip, and strict JSON, before the schema is validated.

`read_body` reads a request's body for every door: the events door (ingest_path.py) and
the API router's route class, `BodyRoute`, whose request object reads its body with it. It
- refuses bodies over `Settings.max_batch_bytes` (413), counting as it reads and again
  after decompressing, so neither a large upload nor a gzip bomb gets through;
- decompresses `Content-Encoding: gzip`: one whole gzip member and nothing after it, else
  400 naming the header; another encoding is a 415.
`loads_strict` parses JSON strictly: NaN/Infinity, numbers that overflow a float or a
64-bit integer, and strings that the database cannot store (NUL, lone surrogates) are
422s that say so, instead of values that would fail later inside an INSERT (the
`BodyRequest`'s `json()`, and the events decoder's careful pass, decode.py).

Parsing is the ingest path's first cost per rank-step. orjson parses a body in C and
refuses NaN, Infinity, floats that overflow and unpaired surrogates by itself; a body it
refuses, or whose text holds an integer part of 19 digits or more (an integer that may not
fit 64 bits: orjson would read it as a float; `may_hold_long_int`), goes through the
standard library's parser with a check per number, which says precisely what is wrong.
Valid bodies never take that path. Only runs that do not follow a "." count: the shortest
text of a float below 0.01 has a fraction of 19 digits or more (orjson writes 4.2e-4 at
full precision as 0.0004186889117305184), and a real run's latencies are such floats.
The runs are found by mapping every digit to "0", "." to itself and everything else to a
space (`bytes.translate`) and searching for a space and nineteen "0"s: a regular expression
tries a match at every digit of every number, seven times the cost of parsing the body.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping, MutableMapping
from typing import Any

import orjson
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from zerowatch.server.auth import request_headers
from zlib_ng import zlib_ng

#: zlib-ng's error (its stub types it as a value, not a class).
_INFLATE_ERROR: type[Exception] = zlib_ng.error  # type: ignore[assignment]

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

INT64_MAX = 2**63 - 1
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
#: Digits to "0", "." to itself, every other byte to " ".
_TO_DIGIT_RUNS = bytes(0x30 if 0x30 <= b <= 0x39 else b if b == 0x2E else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def may_hold_long_int(raw: bytes) -> bool:
    """Whether the JSON text `raw` may hold an integer literal of 19 digits or more (one
    that may not fit 64 bits): a run of 19 digits that does not follow a "." (a fraction's
    digits) anywhere, strings included (a false alarm costs the careful parser, never a
    wrong answer)."""
    runs = raw.translate(_TO_DIGIT_RUNS)
    return b" " + _LONG_RUN in runs or runs.startswith(_LONG_RUN)


class BodyError(ValueError):
    pass


def _parse_int(text: str) -> int:
    n = int(text)
    if not -INT64_MAX - 1 <= n <= INT64_MAX:
        raise BodyError(f"integer {text[:30]} does not fit in 64 bits")
    return n


def _parse_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise BodyError(f"number {text[:30]} is out of range")
    return x


def _parse_constant(name: str) -> Any:
    raise BodyError(f"{name} is not allowed: numbers must be finite")


def _has_nul(obj: Any) -> bool:
    if isinstance(obj, str):
        return "\x00" in obj
    if isinstance(obj, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_nul(v) for v in obj)
    return False


def _check_strings(obj: Any) -> None:
    json.dumps(obj, ensure_ascii=False).encode("utf-8")


def loads_strict(raw: bytes) -> Any:
    """Parse JSON that the store can hold as is; raise BodyError or json.JSONDecodeError."""
    # Text the fast parser may not read as the strict one would (see the module docstring).
    if not may_hold_long_int(raw):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the strict parser below says what is wrong, in its own words
        else:
            if b"\\u0000" in raw and _has_nul(obj):
                raise BodyError("strings must not contain NUL characters (\\u0000)")
            return obj
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"body is not UTF-8 (byte {e.start})") from None
    obj = json.loads(
        text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
    )
    # The text test is cheap and rare; only then look at the parsed strings (an escaped
    # backslash followed by "u0000" is legal text, not a NUL).
    if "\\u0000" in text and _has_nul(obj):
        raise BodyError("strings must not contain NUL characters (\\u0000)")
    if _SURROGATE.search(text):
        try:
            _check_strings(obj)
        except UnicodeEncodeError:
            raise BodyError("strings must not contain unpaired surrogates") from None
    return obj


def _error(loc: tuple[str | int, ...], msg: str, kind: str) -> HTTPException:
    # An HTTPException (not RequestValidationError): FastAPI re-raises it from body parsing.
    return HTTPException(422, [{"type": kind, "loc": list(loc), "msg": msg}])


class BodyRequest(Request):
    """A request whose body is size-limited, gunzipped and strictly parsed."""

    def _limit(self) -> int:
        settings = getattr(self.app.state, "settings", None)
        return int(getattr(settings, "max_batch_bytes", 16 * 2**20))

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            headers = request_headers(self.scope.get("headers", ()))
            self._body = await read_body(self.receive, headers, self._limit())
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = loads_strict(body)
            except BodyError as e:
                raise _error(("body",), str(e), "value_error") from None
            _check_lists(self._json)
        return self._json


#: The longest list a JSON body's fields may hold before validation: a list of thousands
#: of wrong items makes thousands of errors (131,072 tags: 11.8 MB and an 8 s stall). The
#: fields' own limits (store.py) are smaller; this bounds the work before they are checked.
MAX_LIST = 16_384


def _check_lists(obj: Any) -> None:
    """413 naming the field whose list is longer than MAX_LIST (the body's own fields)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, list) and len(value) > MAX_LIST:
                raise HTTPException(413, [{"type": "too_long", "loc": ["body", key],
                                           "msg": f"at most {MAX_LIST:,} items, got {len(value):,}"}])  # fmt: skip


async def read_body(receive: Receive, headers: Mapping[bytes, bytes], limit: int) -> bytes:
    """The request's body, inflated when it is gzip.

    Args:
        receive: the ASGI receive of the request.
        headers: its headers (auth.request_headers).
        limit: the most bytes the body may hold, sent or inflated (`max_batch_bytes`).

    Raises:
        HTTPException: 413 past `limit` (declared, read or inflated), 400 for a body that
            is not whole gzip, 415 for an encoding other than gzip or identity.
        ClientDisconnect: the client went away.
    """
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(
            413, f"request body of {declared.decode()} bytes exceeds max_batch_bytes ({limit})"
        )
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body exceeds max_batch_bytes ({limit})")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    raw = b"".join(chunks)
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    if encoding == b"gzip":
        return gunzip(raw, limit) if raw else raw
    if encoding not in (b"identity", b""):
        shown = encoding.decode("latin-1")
        raise HTTPException(415, f"Content-Encoding {shown!r} is not supported (use gzip)")
    return raw


def gunzip(raw: bytes, limit: int) -> bytes:
    """The body a gzip upload holds, at most `limit` bytes (413 beyond, 400 when it is not
    one whole gzip member and nothing after it). zlib-ng, zlib's API: it inflates an agent's batch in 60% of zlib's time
    (2.2 against 3.7 µs a rank-step at 4,096 ranks, measured in-process)."""
    d = zlib_ng.decompressobj(wbits=16 + zlib_ng.MAX_WBITS)
    try:
        out = d.decompress(raw, limit + 1)
        if len(out) > limit or d.unconsumed_tail:
            raise HTTPException(413, f"decompressed body exceeds max_batch_bytes ({limit})")
        out += d.flush()
        if len(out) > limit:
            raise HTTPException(413, f"decompressed body exceeds max_batch_bytes ({limit})")
    except _INFLATE_ERROR as e:
        raise HTTPException(
            400, f"Content-Encoding: gzip, but the body is not valid gzip ({e})"
        ) from None
    if not d.eof:
        raise HTTPException(400, "Content-Encoding: gzip, but the gzip stream is truncated")
    if d.unused_data:  # a second member, or junk: not what the agent sent, so not stored
        raise HTTPException(
            400,
            f"Content-Encoding: gzip, but {len(d.unused_data)} bytes follow the gzip stream "
            "(send one gzip member and nothing after it)",
        )
    return out


class BodyRoute(APIRoute):
    """APIRoute whose handlers see a BodyRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(BodyRequest(request.scope, request.receive))

        return route_handler


__all__ = [
    "BodyRequest",
    "BodyRoute",
    "gunzip",
    "loads_strict",
    "may_hold_long_int",
    "read_body",
]
