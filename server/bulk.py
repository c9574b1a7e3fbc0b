"""Multi-row INSERTs of plain tuples: the ingest writer's statements, below SQLAlchemy's
per-row parameter handling.

A 4,096-rank job stores thousands of rows a second. Handed to SQLAlchemy as one dict per
row, every value of every row goes through a bind processor (the JSON columns through
`json.dumps`): that was most of the writer thread's time. Here a statement is compiled once
by SQLAlchemy (so its ON CONFLICT / RETURNING clauses are SQLAlchemy's own), and its rows
are given as tuples in the statement's column order, with the JSON columns written by
orjson:

- SQLite: `INSERT ... VALUES (?, ...), (?, ...), ... <clauses>`, at most `SQLITE_ROWS` rows
  a statement (SQLite allows 32,766 parameters), one flat parameter tuple.
- PostgreSQL: `INSERT ... SELECT * FROM unnest(CAST(%(c)s AS type[]), ...) <clauses>`: one
  array parameter per column, so the statement text is the same for any number of rows
  (psycopg parses a new text anew: with SQLAlchemy's multi-row VALUES that parse was half
  of the server's ingest time).

A JSON column's value is stored as SQLAlchemy's JSON type stores it (None is the JSON null,
not SQL NULL), so every reader sees the same documents.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from sqlalchemy import JSON, Boolean, Connection, Float, Integer
from sqlalchemy.dialects import postgresql, sqlite

#: Rows of one SQLite statement (parameters = rows x columns stay under 32,766).
SQLITE_ROWS = 500


def json_text(value: Any) -> str:
    """A JSON column's text: orjson, or the standard library for what orjson refuses (an
    integer beyond 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"))


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
        # Each column's values made its column's Python type: psycopg types an array by
        # its elements and refuses a list that mixes int and float (or bool and int).
        self._json = [isinstance(table.c[c].type, JSON) for c in self.columns]
        self._as: list[Callable[[Any], Any]] = [
            json_text if isinstance(t, JSON)
            else float if isinstance(t, Float)
            else bool if isinstance(t, Boolean)
            else int if isinstance(t, Integer)
            else str
            for t in (table.c[c].type for c in self.columns)
        ]  # fmt: skip
        d = postgresql.dialect() if dialect == "postgresql" else sqlite.dialect()
        compiled = stmt.compile(dialect=d, column_keys=list(self.columns))
        text = str(compiled)
        at = text.find(" ON CONFLICT")
        tail = text[at:] if at >= 0 else ""
        head = f"INSERT INTO {table.name} ({', '.join(self.columns)})"
        if dialect == "postgresql":
            arrays = ", ".join(
                f"CAST(%({c})s AS {table.c[c].type.compile(dialect=d)}[])" for c in self.columns
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

    def execute(self, conn: Connection, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Insert `rows`; returns the RETURNING rows (empty without a RETURNING clause)."""
        if not rows:
            return []
        if self.dialect == "postgresql":
            params: dict[str, Any] = dict(self._constants)
            for c, to, is_json, values in zip(
                self.columns, self._as, self._json, zip(*rows, strict=True), strict=True
            ):
                if is_json:  # JSON: None is the JSON null, not SQL NULL
                    params[c] = [to(v) for v in values]
                else:
                    params[c] = [None if v is None else to(v) for v in values]
            result = conn.exec_driver_sql(self._pg_sql, params)
            return list(result) if result.returns_rows else []
        out: list[Any] = []
        json_at = [i for i, j in enumerate(self._json) if j]
        for i in range(0, len(rows), SQLITE_ROWS):
            chunk = rows[i : i + SQLITE_ROWS]
            sql = self._sql_by_n.get(len(chunk))
            if sql is None:
                sql = self._head + ", ".join([self._group] * len(chunk)) + self._tail
                self._sql_by_n[len(chunk)] = sql
            flat: list[Any] = []
            if json_at:
                for row in chunk:
                    cells = list(row)
                    for j in json_at:
                        cells[j] = json_text(cells[j])
                    flat.extend(cells)
            else:
                for row in chunk:
                    flat.extend(row)
            flat.extend(self._tail_params)
            result = conn.exec_driver_sql(sql, tuple(flat))
            if result.returns_rows:
                out.extend(result)
        return out


__all__ = ["SQLITE_ROWS", "TupleInsert", "json_text"]
