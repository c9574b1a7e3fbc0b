"""The JSON answer of every error, defined once for the FastAPI app and the events door.

The app's exception handlers (app.py) and the events door (ingest_path.py, which answers
agents' batches in front of FastAPI) both turn an exception into its answer here, so an
error reads the same whichever of them met it:

- `HTTPException`: its status, `{"detail": ...}` and its headers (FastAPI's own handler);
- `RequestValidationError`: 422, `{"detail": [{"type", "loc", "msg", "ctx"?}, ...],
  "message": "loc: msg; ..."}` (each error without its input);
- a database error (`DBAPIError`): 503 or 507 naming the cause with Retry-After
  (db_errors.py), or a logged 500 without internals;
- anything else (only the events door meets it outside FastAPI): a logged 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from zerowatch.server import db_errors

log = logging.getLogger("zerowatch.server")


#: Errors one answer lists at most (the rest counted): server/decode.py's MAX_ERRORS.
MAX_ERRORS = 20


def _message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "; ".join(parts)


def validation_answer(errors: Sequence[Any]) -> JSONResponse:
    """422 listing each error (without its input) and a one-line message."""
    # At most MAX_ERRORS + 1 listed: the last may be decode.py's count of the rest.
    many = len(errors) > MAX_ERRORS + 1
    cleaned = []
    for e in errors[: MAX_ERRORS if many else MAX_ERRORS + 1]:
        e = {k: v for k, v in e.items() if k not in ("input", "url")}
        cleaned.append(jsonable_encoder(e, custom_encoder={Exception: str}))
    if many:
        cleaned.append({"type": "too_many_errors", "loc": ["body"],
                        "msg": f"{len(errors) - MAX_ERRORS:,} more errors left out"})  # fmt: skip
    return JSONResponse({"detail": cleaned, "message": _message(cleaned)}, status_code=422)


def database_answer(exc: DBAPIError, method: str, path: str) -> JSONResponse:
    """503/507 with Retry-After for a database that is away or full; else a logged 500."""
    answer = db_errors.classify(exc)
    if answer is None:
        log.error("database error on %s %s", method, path, exc_info=exc)
        return JSONResponse({"detail": "internal server error"}, status_code=500)
    log.warning("%s %s: %d: %s", method, path, answer.status, answer.detail)
    return JSONResponse(
        {"detail": answer.detail},
        status_code=answer.status,
        headers={"Retry-After": str(answer.retry_after_s)},
    )


def answer(exc: Exception, method: str, path: str) -> JSONResponse:
    """The answer to `exc`, raised while serving `method path` (see the module docstring)."""
    if isinstance(exc, HTTPException):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=exc.headers)  # fmt: skip
    if isinstance(exc, RequestValidationError):
        return validation_answer(exc.errors())
    if isinstance(exc, DBAPIError):
        return database_answer(exc, method, path)
    log.error("unexpected error on %s %s", method, path, exc_info=exc)
    return JSONResponse({"detail": "internal server error"}, status_code=500)


__all__ = ["answer", "database_answer", "validation_answer"]
