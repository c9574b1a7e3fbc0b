"""Fixtures for the server's tests: a store on SQLite and on a real PostgreSQL, an app, and
helpers that turn simulated runs (zerowatch.simulate) into request bodies."""

from __future__ import annotations

import dataclasses
import gzip
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.postgres import postgres, postgres_available
from zerowatch.server.app import create_app
from zerowatch.server.db import Database
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate


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
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'zerowatch.db'}"


@pytest.fixture
def client(sqlite_url: str) -> Iterator[TestClient]:
    """The app on a temp SQLite file, no token."""
    with TestClient(create_app(Settings(db_url=sqlite_url))) as c:
        yield c


def asdict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


def batch_body(run_id: str, events: list[Any], **extra: Any) -> dict[str, Any]:
    return {"schema_version": ev.SCHEMA_VERSION, "run_id": run_id,
            "events": [asdict(e) for e in events], **extra}  # fmt: skip


def gz(body: Any) -> bytes:
    return gzip.compress(json.dumps(body).encode())


def post_events(
    client: Any, run_id: str, events: list[Any], headers: dict[str, str] | None = None
) -> Any:
    """POST a gzip batch, as the agent does."""
    return client.post(
        f"/api/v1/runs/{run_id}/events",
        content=gz(batch_body(run_id, events)),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json", **(headers or {})},
    )


def create_sim_run(
    client: Any, spec: simulate.SimSpec, headers: dict[str, str] | None = None
) -> str:
    rc = simulate.run_create(spec)
    r = client.post("/api/v1/runs", json=asdict(rc), headers=headers or {})
    assert r.status_code == 201, r.text
    return rc.run_id
