"""Who is asking, read one way: the request's deciding headers and the token check.

Every place that authenticates a request calls `authenticate` on the headers of
`request_headers`: the events door (ingest_path.py), the admission middleware (before a
request takes an ingest slot, so one without the token holds none) and the routes'
dependencies (deps.py). Both work on the ASGI scope alone, before any of the body is read.

A header that decides the request (Authorization, Content-Type, Content-Encoding) sent
twice is a 400 naming it. A layer that reads the first copy and one that reads the last
would otherwise disagree: `Authorization: Bearer nope` then `Authorization: Bearer <token>`
is refused by one and let in by the other.

Token rules (with `Settings.token` set): `Authorization: Bearer <token>`, the scheme in
any case, the credentials compared in constant time; no such header, another scheme or
empty credentials are a 401 with `WWW-Authenticate: Bearer`, another token a 403.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

from fastapi import HTTPException

#: The headers a request must send at most once, by their names as ASGI spells them.
ONCE = {
    b"authorization": "Authorization",
    b"content-type": "Content-Type",
    b"content-encoding": "Content-Encoding",
}


def request_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The request's headers by lowercase name (an ASGI scope's `headers`).

    Raises:
        HTTPException: 400 naming a header of `ONCE` that came twice.
    """
    found: dict[bytes, bytes] = {}
    for name, value in raw:
        name = name.lower()
        if name in found and name in ONCE:
            raise HTTPException(400, f"the {ONCE[name]} header is sent twice: send it once")
        found[name] = value
    return found


def authenticate(token: str | None, headers: Mapping[bytes, bytes]) -> None:
    """Pass when no token is configured or the request carries it (see the module docstring).

    Args:
        token: the server's token (`Settings.token`); None: every request passes.
        headers: the request's headers, from `request_headers`.

    Raises:
        HTTPException: 401 without a bearer token, 403 with another one.
    """
    if token is None:
        return
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, credentials = authorization.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        raise HTTPException(
            401,
            "this server needs a token: send Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(credentials.encode(), token.encode()):
        raise HTTPException(403, "wrong token")


__all__ = ["ONCE", "authenticate", "request_headers"]
