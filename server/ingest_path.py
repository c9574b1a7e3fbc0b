"""The events door: every `POST /api/v1/runs/{run_id}/events`, answered in front of FastAPI.

Every agent POSTs its batches here: 256 requests a second from a 4,096-rank job. Through
FastAPI a request walks the router's routes, solves the route's dependencies and builds
its response (about 0.4 ms of CPU a POST, half of the event loop's time for a POST of 16
steps, measured in-process), and walks the middleware stack again each time its task
resumes and for every message it sends (~5 us a rank-step at 16 steps a POST). So the
app's edge (`App.__call__`) hands such a request to `IngestFastPath`, which does the whole of
it, in this order:

1. the headers (auth.request_headers: a deciding header sent twice is a 400) and the
   token (auth.authenticate: 401/403), from the scope alone: a request without the token
   is answered before its body is read and never takes an ingest slot;
2. admission (admission.admitted: 503 + Retry-After past the bound), the request marked so
   that the admission middleware does not count it again;
3. `store_batch`: the body (body.read_body: size limit, gzip), the batch
   (decode.decode_batch: one decoder, msgspec first, the careful pass for the rest and for
   the 422s), the ingest writer, 404 for an unknown run, 422 for a batch the store refuses;
4. the answer, with the security headers; an error is answered by errors.answer, the
   function the FastAPI app's exception handlers use too.

The FastAPI route (api.py `ingest`) is a thin adapter over `store_batch`, for an app served
without this edge and for the OpenAPI description; it authenticates with the same function
(deps.require_write). A URL the route would not match (an empty run id, one holding "/"
or too long, a NUL anywhere) is left to FastAPI, which answers it as any other URL.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from fastapi import HTTPException
from starlette.requests import ClientDisconnect
from zerowatch.server import errors, store
from zerowatch.server.admission import ADMITTED, admitted
from zerowatch.server.auth import authenticate, request_headers
from zerowatch.server.body import read_body
from zerowatch.server.decode import decode_batch
from zerowatch.server.security import HEADERS

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PREFIX = "/api/v1/runs/"
SUFFIX = "/events"


async def store_batch(
    state: Any, run_id: str, headers: Mapping[bytes, bytes], receive: Receive
) -> store.IngestResult:
    """Read, decode and store the batch of an authenticated, admitted request.

    Args:
        state: the app's state (settings, ingestor).
        run_id: the run of the URL.
        headers: the request's headers (auth.request_headers).
        receive: the request's ASGI receive.

    Returns:
        What the batch did (events newly stored, duplicates).

    Raises:
        HTTPException: 413, 400, 415 (the body), 422 (JSON the store cannot hold, a batch
            the store refuses), 404 (an unknown run).
        RequestValidationError: 422, the batch does not match the schema.
        ClientDisconnect: the client went away.
        DBAPIError: the database failed (errors.answer says how to answer it).
    """
    raw = await read_body(receive, headers, int(state.settings.max_batch_bytes))
    batch = decode_batch(raw, headers.get(b"content-type"))
    try:
        result = await state.ingestor.submit_async(run_id=run_id, batch=batch)
    except store.BatchError as e:
        raise HTTPException(
            422, [{"type": "value_error", "loc": list(e.loc), "msg": e.msg}]
        ) from None
    if result is None:
        raise HTTPException(404, f"run {run_id!r} not found")
    return result


class IngestFastPath:
    """The app's edge for agents' event batches (see the module docstring).

    `app` is the FastAPI app (its middleware and routes), which answers every other
    request; `state` is the app's (settings, ingestor and admission are read at each
    request)."""

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
            or not _is_run_id(path[len(PREFIX) : -len(SUFFIX)])
            or "\x00" in path
            or b"%00" in scope.get("raw_path", b"")
            or b"%00" in scope.get("query_string", b"")
        ):
            await self.app(scope, receive, send)
            return
        try:
            headers = request_headers(scope.get("headers", ()))
            authenticate(self.state.settings.token, headers)
        except HTTPException as e:
            await _answer(e, scope, receive, send)
            return
        scope[ADMITTED] = True
        handler = functools.partial(self._store, headers)
        await admitted(self.state.admission, handler, scope, receive, send, HEADERS)

    async def _store(
        self, headers: Mapping[bytes, bytes], scope: Message, receive: Receive, send: Send
    ) -> None:
        path = scope["path"]
        try:
            result = await store_batch(
                self.state, path[len(PREFIX) : -len(SUFFIX)], headers, receive
            )
        except ClientDisconnect:
            return  # nobody to answer
        except Exception as e:
            await _answer(e, scope, receive, send)
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


def _is_run_id(run_id: str) -> bool:
    """Whether the route takes this run id (a path segment of 1 to MAX_RUN_ID_CHARS)."""
    return 0 < len(run_id) <= store.MAX_RUN_ID_CHARS and "/" not in run_id


async def _answer(exc: Exception, scope: Message, receive: Receive, send: Send) -> None:
    """Answer `exc` as the FastAPI app would (errors.answer), with the security headers."""
    response = errors.answer(exc, scope["method"], scope["path"])
    response.raw_headers.extend(HEADERS)
    await response(scope, receive, send)


__all__ = ["IngestFastPath", "store_batch"]
