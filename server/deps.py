"""Dependencies shared by the routes: settings, database, and the token checks.

The app keeps one `Settings` and one `Database` on `app.state`; routes take them through
the `Annotated` aliases below (the events route reaches the app's `Ingestor` on
`app.state` itself, as the ingest fast path does). Token rules: with `Settings.token` set, ingest and
delete need `Authorization: Bearer <token>` (401 without it, 403 with another), and reads
need it too when `read_requires_token` is set.

The dependencies are `async def` on purpose: they do no I/O, and FastAPI runs a plain `def`
dependency in the thread pool, a thread hop per dependency per request.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from zerowatch.server.db import Database
from zerowatch.server.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="The server's token (ZEROWATCH_TOKEN).")


async def _settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def _db(request: Request) -> Database:
    return request.app.state.db  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(_settings)]
DbDep = Annotated[Database, Depends(_db)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def check_token(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Raise 401/403 unless the request carries the configured token (or none is set)."""
    if settings.token is None:
        return
    if credentials is None or not credentials.credentials:
        raise HTTPException(
            401,
            "this server needs a token: send Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(credentials.credentials.encode(), settings.token.encode()):
        raise HTTPException(403, "wrong token")


async def require_write(request: Request, credentials: Credentials) -> None:
    """Ingest and delete: the token when one is configured. (The settings come straight from
    the app, not through SettingsDep: one dependency fewer to solve on the ingest path.)"""
    check_token(request.app.state.settings, credentials)


async def require_read(request: Request, credentials: Credentials) -> None:
    """Reads: the token only when `read_requires_token` is set."""
    settings: Settings = request.app.state.settings
    if settings.read_requires_token:
        check_token(settings, credentials)


__all__ = [
    "Credentials",
    "DbDep",
    "SettingsDep",
    "check_token",
    "require_read",
    "require_write",
]
