"""The one decoder of an events body: its bytes to an `events.EventBatch`, or the 422 that
says what is wrong, exactly as FastAPI would validate a route's body.

`decode_batch` is two passes behind one answer:

- **fast** (`fast_batch`): one pass of msgspec that parses and validates together, for the
  body an agent sends almost always (step events only). A step event and its collectives
  records are decoded into msgspec Structs made from the events' dataclasses (`_mirror`:
  the same fields, types and defaults), which msgspec builds in two thirds of a
  dataclass's time (8.1 against 11.4 µs a rank-step, in-process); the writer reads events
  by attribute only (store.py), so either kind serves it. The smaller records (memory,
  offload, spans) stay the dataclasses the store serialises. The careful pass costs ~19 µs
  a rank-step, this one ~7.
- **careful** (`careful_batch`): strict JSON (body.py's `loads_strict`: NaN, overflowing
  numbers, integers past 64 bits, NUL and unpaired surrogates refused), then pydantic's
  validation of the parsed objects as FastAPI validates a body (lax mode, errors located
  under "body"). It decides every body the fast pass leaves: an end event (one per rank
  per run), anything msgspec refuses, and the JSON msgspec would read but the careful
  pass refuses (a NUL in a string; a run of 19 digits, an integer that may not fit 64
  bits), which is screened before msgspec sees it. Its errors are the answers.

msgspec is stricter than pydantic's lax mode (it refuses `1.0` for an int, `1` for a
bool), never laxer, so a body the fast pass decodes is one the careful pass accepts, with
the same values; tests/server/test_ingest_fast_path.py holds the two passes to that over
valid, edge and invalid bodies.
"""

from __future__ import annotations

import dataclasses
import email.message
import functools
import json
import operator
import types
import typing
from typing import Any

import msgspec
import pydantic
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from zerowatch.server.body import BodyError, loads_strict, may_hold_long_int

from zerowatch import events as ev

#: Events one batch may carry (an agent sends at most its batch_max_events, 64; `zerowatch
#: upload` 256; a simulator a step of 4,096 ranks and more), and validation errors one
#: answer lists: a small body of thousands of empty events was a 72 MB answer after 43 s.
MAX_EVENTS = 16_384
MAX_ERRORS = 20


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


_FAST = msgspec.json.Decoder(_StepBatch)
_CAREFUL = pydantic.TypeAdapter(ev.EventBatch)
_EVENT: pydantic.TypeAdapter[ev.StepEvent | ev.EndEvent] = pydantic.TypeAdapter(
    ev.StepEvent | ev.EndEvent
)


def is_json(content_type: bytes | None) -> bool:
    """Whether a body of this Content-Type is JSON to FastAPI: application/json or
    application/*+json (parameters aside). Without one, a body is not JSON."""
    if content_type == b"application/json":  # what agents send: no parsing
        return True
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def decode_batch(raw: bytes, content_type: bytes | None) -> ev.EventBatch:
    """The batch a request body holds (see the module docstring).

    Args:
        raw: the body, inflated.
        content_type: the request's Content-Type header (a body that is not JSON is
            validated as bytes, and refused, as FastAPI does).

    Returns:
        The batch: its step events msgspec Structs (fast pass) or the events' dataclasses.

    Raises:
        RequestValidationError: 422, the errors located under "body".
        HTTPException: 422 for JSON the store cannot hold (naming why).
    """
    json_body = is_json(content_type)
    if json_body and raw:
        batch = fast_batch(raw)
        if batch is not None:
            return batch
    return careful_batch(raw, json_body=json_body)


def fast_batch(raw: bytes) -> ev.EventBatch | None:
    """The batch of a JSON body of step events (its events the Structs of `_mirror`); None
    when the body is the careful pass's to judge."""
    # (A backslash is rare in an agent's JSON: one memchr before the search for \\u0000.)
    if (b"\\" in raw and b"\\u0000" in raw) or may_hold_long_int(raw):
        return None
    try:
        b = _FAST.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError):  # (bytes that are not UTF-8)
        return None
    _check_count(b.events)
    return ev.EventBatch(b.run_id, b.events, b.schema_version)  # type: ignore[arg-type]


def careful_batch(raw: bytes, *, json_body: bool = True) -> ev.EventBatch:
    """The batch of a body as FastAPI validates a route's body (see `decode_batch`)."""
    if not raw:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    obj: Any = raw
    if json_body:
        try:
            obj = loads_strict(raw)
        except BodyError as e:
            raise HTTPException(
                422, [{"type": "value_error", "loc": ["body"], "msg": str(e)}]
            ) from None
        except json.JSONDecodeError as e:
            error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error"}
            raise RequestValidationError(
                [{**error, "input": {}, "ctx": {"error": e.msg}}]
            ) from None
    events = obj.get("events") if isinstance(obj, dict) else None
    if not isinstance(events, list):  # no list to go through: the batch's own answer
        try:
            return _CAREFUL.validate_python(obj, from_attributes=True)
        except pydantic.ValidationError as e:
            raise RequestValidationError(_located(e, ("body",), MAX_ERRORS)) from None
    _check_count(events)
    # The batch without its events, then each event: an answer lists the first MAX_ERRORS
    # errors and counts the others without building them (pydantic builds every error of
    # a whole batch: 147,000 of them for 16,384 empty events, 150 MB).
    errors: list[dict[str, Any]] = []
    left_out = 0
    try:
        batch = _CAREFUL.validate_python({**obj, "events": []}, from_attributes=True)
    except pydantic.ValidationError as e:
        batch = None
        errors = _located(e, ("body",), MAX_ERRORS)
        left_out = e.error_count() - len(errors)
    decoded = []
    for i, event in enumerate(events):
        try:
            decoded.append(_EVENT.validate_python(event, from_attributes=True))
        except pydantic.ValidationError as e:
            room = MAX_ERRORS - len(errors)
            taken = _located(e, ("body", "events", i), room) if room > 0 else []
            errors += taken
            left_out += e.error_count() - len(taken)
    if errors or batch is None:
        raise RequestValidationError(errors + _more(left_out))
    batch.events = decoded
    return batch


def _located(e: pydantic.ValidationError, at: tuple[Any, ...], limit: int) -> list[dict[str, Any]]:
    """The first `limit` errors of `e`, located under `at`."""
    return [{**x, "loc": (*at, *x["loc"])} for x in e.errors(include_url=False)[:limit]]


def _check_count(events: Any) -> None:
    """413 for a batch of more than MAX_EVENTS events, before any of them is validated."""
    if isinstance(events, list) and len(events) > MAX_EVENTS:
        raise HTTPException(413, [{"type": "too_long", "loc": ["body", "events"],
                                   "msg": f"at most {MAX_EVENTS:,} events a batch, got "
                                          f"{len(events):,}"}])  # fmt: skip


def _more(n: int) -> list[dict[str, Any]]:
    """The one error that stands for the `n` left out of an answer."""
    if n <= 0:
        return []
    return [{"type": "too_many_errors", "loc": ("body",),
             "msg": f"{n:,} more errors left out (the first {MAX_ERRORS} are listed)"}]  # fmt: skip


__all__ = ["careful_batch", "decode_batch", "fast_batch", "is_json"]
