"""Multi-row INSERTs of plain tuples: the ingest writer's statements, below SQLAlchemy's
per-row parameter handling.

A 4,096-rank job stores thousands of rows a second. Handed to SQLAlchemy as one dict per
row, every value of every row goes through a bind processor (the JSON columns through
`json.dumps`): that was most of the writer thread's time. Here a statement is compiled once
by SQLAlchemy (so its ON CONFLICT / RETURNING clauses are SQLAlchemy's own), and its rows
are given as tuples in the statement's column order, with the JSON columns written by
orjson:

- SQLite: a statement without RETURNING is prepared once for one row and run over all rows
  by the driver (`executemany`); one with RETURNING (the steps' insert, which tells which
  events are new) as `INSERT ... VALUES (?, ...), (?, ...), ... <clauses>` in chunks of a
  few fixed sizes, so SQLite prepares each text once (a new text for every group's row
  count made preparing most of the writer's time when groups were small).
- PostgreSQL: `INSERT ... SELECT * FROM unnest(CAST(%(c)b AS type[]), ...) <clauses>`: one
  array parameter per column, so the statement text is the same for any number of rows
  (psycopg parses a new text anew: with SQLAlchemy's multi-row VALUES that parse was half
  of the server's ingest time). The arrays go in PostgreSQL's binary format (`%b`): in the
  text format psycopg quotes every element of an array in Python, with a regular expression
  over each JSON document, which was 40% of the server's CPU per rank-step. The arrays are
  built here (`pg_array`): psycopg's own binary array dumper still spends a few Python
  calls on every element (a dumper lookup, a length prefix, two appends: a third of the
  writer's time on PostgreSQL), where numpy packs a column of numbers in one pass and a
  column of text takes one join. A column that does not pack (an integer beyond its type)
  goes through psycopg's dumper instead, which refuses it in its own words.

A JSON column's value is stored as SQLAlchemy's JSON type stores it (None is the JSON null,
not SQL NULL), so every reader sees the same documents.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
from sqlalchemy import JSON, BigInteger, Boolean, Connection, Float, Integer
from sqlalchemy.dialects import postgresql, sqlite


def json_text(value: Any) -> str:
    """A JSON column's text: orjson (a dataclass as the dict of its fields), or the standard
    library for what orjson refuses (an integer beyond 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=_fields)


def _fields(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def json_bytes(value: Any) -> bytes:
    """`json_text` as UTF-8 bytes (orjson's own output, not decoded and encoded again)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json_text(value).encode()


class PgArray(bytes):
    """A one-dimensional PostgreSQL array in its binary wire format (`pg_array`), passed
    to psycopg as it is (the dumper registered below hands the bytes over)."""

    oid: int

    def __new__(cls, data: bytes, oid: int) -> PgArray:
        obj = super().__new__(cls, data)
        obj.oid = oid
        return obj


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How one column's values go to the database: `to` makes a value the column's Python
    type (psycopg types an array by its elements and refuses a list that mixes int and
    float, or bool and int); on PostgreSQL, `dtype` packs it (big-endian numpy; None: text
    or JSON), and the element and array oids name its type (PostgreSQL's fixed catalogue
    numbers)."""

    to: Callable[[Any], Any]
    dtype: str | None
    elem_oid: int
    array_oid: int


_KINDS = {
    "float8": _Kind(float, ">f8", 701, 1022),
    "int8": _Kind(int, ">i8", 20, 1016),
    "int4": _Kind(int, ">i4", 23, 1007),
    "bool": _Kind(bool, "?", 16, 1000),
    "text": _Kind(str, None, 25, 1009),
    "json": _Kind(json_text, None, 114, 199),
}
_HEADER = struct.Struct(">iiiii")  # dimensions, has NULLs, element oid, length, lower bound
_LENGTH = struct.Struct(">i").pack
_NULL = _LENGTH(-1)
_INT4 = (-(2**31), 2**31 - 1)


def pg_array(kind: str, values: Sequence[Any]) -> PgArray:
    """`values` as a PostgreSQL array of `kind` (a key of `_KINDS`) in the binary format of
    `array_send`: a header, then each element as its length (-1: NULL) and its bytes.
    None is SQL NULL, except in a "json" array, where it is the JSON null (as SQLAlchemy's
    JSON type stores it).

    Raises:
        OverflowError / ValueError / TypeError: a value does not fit the kind (the caller
            lets psycopg's dumper refuse it in its own words).
    """
    dtype = _KINDS[kind].dtype
    n = len(values)
    has_null = 0
    body: bytes | bytearray
    if kind == "json":  # None is the JSON null: every element has its bytes
        body = bytearray()
        for v in values:
            # Each document framed and let go at once: orjson's output buffers, kept for a
            # join, cost a fresh allocation each (1-1.5 us a document instead of 0.2).
            b = json_bytes(v)
            body += _LENGTH(len(b))
            body += b
    elif dtype is None:
        parts: list[bytes] = []
        add = parts.append
        for v in values:
            if v is None:
                add(_NULL)
                has_null = 1
            else:
                b = v if type(v) is bytes else str(v).encode()
                add(_LENGTH(len(b)))
                add(b)
        body = b"".join(parts)
    else:
        width = np.dtype(dtype).itemsize
        nulls = None in values
        filled = [0 if v is None else v for v in values] if nulls else values
        if kind in ("int4", "int8"):
            column = np.array(filled, dtype=np.int64)  # OverflowError beyond 64 bits
            if kind == "int4" and n and (column.min() < _INT4[0] or column.max() > _INT4[1]):
                raise OverflowError("a value does not fit int4")
        elif kind == "bool":
            column = np.array([bool(v) for v in filled], dtype=bool)
        else:
            column = np.array(filled, dtype=np.float64)
        rec = np.empty(n, dtype=[("length", ">i4"), ("value", dtype)])
        rec["length"] = width
        rec["value"] = column
        has_null = int(nulls)
        if nulls:
            null = np.fromiter((v is None for v in values), dtype=bool, count=n)
            rec["length"][null] = -1
            keep = np.ones((n, 4 + width), dtype=bool)
            keep[null, 4:] = False  # a NULL is its length alone
            body = rec.view(np.uint8).reshape(n, 4 + width)[keep].tobytes()
        else:
            body = rec.tobytes()
    k = _KINDS[kind]
    return PgArray(_HEADER.pack(1, has_null, k.elem_oid, n, 1) + body, k.array_oid)


def _kind(column_type: Any) -> str:
    """The key of `_KINDS` of a SQLAlchemy column type."""
    if isinstance(column_type, JSON):
        return "json"
    if isinstance(column_type, Float):
        return "float8"
    if isinstance(column_type, BigInteger):
        return "int8"
    if isinstance(column_type, Integer):
        return "int4"
    if isinstance(column_type, Boolean):
        return "bool"
    return "text"


def _register_pg_dumper() -> None:
    """Teach psycopg to pass a `PgArray` as it is (its oid says the type)."""
    try:
        import psycopg
        from psycopg.adapt import Dumper
        from psycopg.pq import Format
    except ImportError:  # a server without PostgreSQL support
        return

    class _PgArrayDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj: Any) -> bytes:
            return bytes(obj)

        def get_key(self, obj: Any, format: Any) -> Any:
            return (type(obj), obj.oid)

        def upgrade(self, obj: Any, format: Any) -> Dumper:
            dumper = _PgArrayDumper(type(obj))
            dumper.oid = obj.oid
            return dumper

    psycopg.adapters.register_dumper(PgArray, _PgArrayDumper)


_register_pg_dumper()


class TupleInsert:
    """One INSERT statement (SQLAlchemy's, with its clauses) run over tuple rows.

    Args:
        stmt: an `insert(table)` of the connection's dialect, with any ON CONFLICT /
            RETURNING clauses; its bound constants (e.g. `coalesce(x, -1)`) are kept.
        columns: the rows' column names, in tuple order.
        dialect: "sqlite" or "postgresql".
    """

    def __init__(self, stmt: Any, columns: Sequence[str], dialect: str) -> None:
        self.columns = tuple(columns)
        self.dialect = dialect
        table = stmt.table
        self._kinds = [_kind(table.c[c].type) for c in self.columns]
        d = postgresql.dialect() if dialect == "postgresql" else sqlite.dialect()
        compiled = stmt.compile(dialect=d, column_keys=list(self.columns))
        text = str(compiled)
        at = text.find(" ON CONFLICT")
        tail = text[at:] if at >= 0 else ""
        head = f"INSERT INTO {table.name} ({', '.join(self.columns)})"
        if dialect == "postgresql":
            arrays = ", ".join(
                f"CAST(%({c})b AS {table.c[c].type.compile(dialect=d)}[])" for c in self.columns
            )
            self._pg_sql = f"{head} SELECT * FROM unnest({arrays}){tail}"
            self._constants = {k: v for k, v in compiled.params.items() if k not in self.columns}
        else:
            self._head, self._tail = head + " VALUES ", tail
            self._group = "(" + ", ".join("?" * len(self.columns)) + ")"
            # The constants of the clauses, in the order of their `?`s (after the rows').
            order = compiled.positiontup or []
            self._tail_params = tuple(compiled.params[k] for k in order[len(self.columns) :])
            self._sql_by_n: dict[int, str] = {}
            self._returning = " RETURNING " in tail

    def execute(self, conn: Connection, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Insert `rows`; returns the RETURNING rows (empty without a RETURNING clause)."""
        if not rows:
            return []
        if self.dialect == "postgresql":
            params: dict[str, Any] = dict(self._constants)
            for c, kind, values in zip(
                self.columns, self._kinds, zip(*rows, strict=True), strict=True
            ):
                try:
                    params[c] = pg_array(kind, values)
                except (OverflowError, ValueError, TypeError):
                    to = _KINDS[kind].to
                    if kind == "json":  # JSON: None is the JSON null, not SQL NULL
                        params[c] = [to(v) for v in values]
                    else:
                        params[c] = [None if v is None else to(v) for v in values]
            result = conn.exec_driver_sql(self._pg_sql, params)
            return list(result) if result.returns_rows else []
        json_at = [i for i, kind in enumerate(self._kinds) if kind == "json"]
        if json_at:
            cells: list[list[Any]] = [list(row) for row in rows]
            for cell in cells:
                for j in json_at:
                    cell[j] = json_text(cell[j])
            rows = [tuple(cell) for cell in cells]  # the JSON columns as text
        if not self._returning:
            # One prepared single-row statement, run for every row in C (executemany).
            conn.exec_driver_sql(self._sql(1), [(*row, *self._tail_params) for row in rows])
            return []
        # RETURNING needs one statement per chunk: chunks of a few sizes (powers of two), so
        # that SQLite prepares a handful of statement texts once and reuses them, instead of
        # preparing a new text of thousands of parameters for every group's row count.
        out: list[Any] = []
        i = 0
        while i < len(rows):
            size = _CHUNKS[0]
            for size in _CHUNKS:
                if size <= len(rows) - i:
                    break
            flat: list[Any] = []
            for row in rows[i : i + size]:
                flat.extend(row)
            flat.extend(self._tail_params)
            out.extend(conn.exec_driver_sql(self._sql(size), tuple(flat)))
            i += size
        return out

    def _sql(self, n: int) -> str:
        sql = self._sql_by_n.get(n)
        if sql is None:
            sql = self._sql_by_n[n] = self._head + ", ".join([self._group] * n) + self._tail
        return sql


#: Rows of one SQLite statement with RETURNING, largest first (rows x columns stays under
#: SQLite's 32,766 parameters).
_CHUNKS = (256, 64, 16, 4, 1)


__all__ = ["PgArray", "TupleInsert", "json_bytes", "json_text", "pg_array"]
