"""Dependencies shared by the routes: settings, database, and the token checks.

The app keeps one `Settings` and one `Database` on `app.state`; routes take them through
the `Annotated` aliases below (the events route reaches the app's `Ingestor` on
`app.state` itself, as the events door does). The token is checked by auth.authenticate,
the one function every door uses: with `Settings.token` set, ingest and delete need
`Authorization: Bearer <token>` (401 without it, 403 with another), and reads need it too
when `read_requires_token` is set.

The dependencies are `async def` on purpose: they do no I/O, and FastAPI runs a plain `def`
dependency in the thread pool, a thread hop per dependency per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from zerowatch.server.auth import authenticate, request_headers
from zerowatch.server.db import Database
from zerowatch.server.settings import Settings

#: Names the bearer scheme in the OpenAPI description (its value is not read: the token is
#: checked by auth.authenticate on the request's own headers).
_bearer = HTTPBearer(auto_error=False, description="The server's token (ZEROWATCH_TOKEN).")


async def _settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def _db(request: Request) -> Database:
    return request.app.state.db  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(_settings)]
DbDep = Annotated[Database, Depends(_db)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def require_write(request: Request, _scheme: Credentials) -> None:
    """Ingest and delete: the token when one is configured; a delete without a configured
    token only where `allow_delete_without_token` says so (any page a browser opens could
    send one). (The settings come straight from the app, not through SettingsDep: one
    dependency fewer to solve.)"""
    settings: Settings = request.app.state.settings
    if (
        request.method == "DELETE"
        and not settings.token
        and not settings.allow_delete_without_token
    ):
        raise HTTPException(
            403, "deleting a run needs a token (ZEROWATCH_TOKEN), or "
            "ZEROWATCH_ALLOW_DELETE_WITHOUT_TOKEN=1 on a server no browser of another site "
            "can reach",
        )  # fmt: skip
    authenticate(settings.token, request_headers(request.scope["headers"]))


async def require_read(request: Request, _scheme: Credentials) -> None:
    """Reads: the token only when `read_requires_token` is set."""
    settings: Settings = request.app.state.settings
    if settings.read_requires_token:
        authenticate(settings.token, request_headers(request.scope["headers"]))


__all__ = [
    "Credentials",
    "DbDep",
    "SettingsDep",
    "require_read",
    "require_write",
]
