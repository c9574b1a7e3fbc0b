"""The ingest writer's PostgreSQL arrays (server/bulk.py `pg_array`), built in the binary
wire format by hand, read back by a real PostgreSQL as the values they were made from:
NULLs beside values, the ends of each integer type, the special floats, text and JSON
with every character a client may send."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import psycopg
import pytest
from zerowatch.server.bulk import pg_array

ODD = "n\"o\\de, {1} 'é😀"

CASES: dict[str, tuple[str, list[Any]]] = {
    "float8": ("float8[]", [1.5, None, -0.0, math.inf, -math.inf, 1e-308, 2, None]),
    "int8": ("int8[]", [0, None, 2**63 - 1, -(2**63), 7]),
    "int4": ("int4[]", [2**31 - 1, -(2**31), None, 3]),
    "bool": ("bool[]", [True, None, False]),
    "text": ("text[]", ["", None, ODD, "x" * 5000]),
    "json": ("json[]", [{"a": [1, 2.5, None]}, None, {ODD: [ODD, {ODD: 2}]}, [], 3]),
}


@pytest.fixture(scope="module")
def pg(pg_server: Any) -> Any:
    url = pg_server.create_database("t_" + uuid.uuid4().hex[:12])
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        yield conn


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_reads_back_as_the_values_it_was_made_from(pg: Any, kind: str) -> None:
    cast, values = CASES[kind]
    rows = pg.execute(
        f"SELECT x, x IS NULL FROM unnest(CAST(%(a)b AS {cast})) WITH ORDINALITY AS t(x, i) "
        "ORDER BY i",
        {"a": pg_array(kind, values)},
    ).fetchall()
    got = [None if is_null else x for x, is_null in rows]
    if kind == "json":  # None is the JSON null, not SQL NULL (as SQLAlchemy's JSON stores it)
        assert not any(is_null for _, is_null in rows)
        assert got == [json.loads(json.dumps(v)) for v in values]
    else:
        assert got == values
    if kind == "float8":  # -0.0 stays -0.0
        signs = [[None if v is None else math.copysign(1, v) for v in vs] for vs in (got, values)]
        assert signs[0] == signs[1]


def test_nan_reads_back_as_nan(pg: Any) -> None:
    (x,) = pg.execute(
        "SELECT (CAST(%(a)b AS float8[]))[1]", {"a": pg_array("float8", [math.nan])}
    ).fetchone()
    assert math.isnan(x)


def test_an_empty_column_is_an_empty_array(pg: Any) -> None:
    (n,) = pg.execute(
        "SELECT cardinality(CAST(%(a)b AS int8[]))", {"a": pg_array("int8", [])}
    ).fetchone()
    assert n == 0


@pytest.mark.parametrize(
    ("kind", "value"), [("int4", 2**31), ("int4", -(2**31) - 1), ("int8", 2**63)]
)
def test_an_integer_beyond_its_type_is_refused_for_psycopg_to_judge(kind: str, value: int) -> None:
    with pytest.raises(OverflowError):
        pg_array(kind, [1, value])
