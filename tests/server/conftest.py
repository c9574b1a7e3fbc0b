"""Fixtures for the server's tests: a store on SQLite and on a real PostgreSQL, an app, and
helpers that turn simulated runs (zerowatch.simulate) into request bodies."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.postgres import postgres, postgres_available
from zerowatch.server.app import create_app
from zerowatch.server.db import Database
from zerowatch.server.read.rollups import ReadTuning
from zerowatch.server.settings import Settings


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    """One PostgreSQL cluster for the session (each test gets its own database)."""
    if not postgres_available():
        pytest.fail(
            "PostgreSQL binaries not found (/usr/lib/postgresql/*/bin): run .ci/system-deps "
            "(apt-get install postgresql)"
        )
    with postgres() as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database URL: a SQLite file, or a new database on the PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'zerowatch.db'}"
    pg = request.getfixturevalue("pg_server")
    return str(pg.create_database("t_" + uuid.uuid4().hex[:12]))


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database.open(db_url)
    yield database
    database.close()


@pytest.fixture
def tuned_db(db_url: str) -> Iterator[Any]:
    """Open the test's database with some of the read path's tuning changed:
    `tuned_db(max_live_rank_steps=24)` (closed at the end of the test)."""
    opened: list[Database] = []

    def open_(**tuning: Any) -> Database:
        opened.append(Database.open(db_url, tuning=ReadTuning(**tuning)))
        return opened[-1]

    yield open_
    for database in opened:
        database.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'zerowatch.db'}"


@pytest.fixture
def client(sqlite_url: str) -> Iterator[TestClient]:
    """The app on a temp SQLite file, no token."""
    with TestClient(create_app(Settings(db_url=sqlite_url))) as c:
        yield c
