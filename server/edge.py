"""The server's edge: what a connection and a Host header may do before the app sees them.

- `deadline_protocol(head_s, body_s)`: uvicorn's HTTP protocol (httptools) with two
  deadlines per request. A connection must deliver a request's head (its request line and
  headers) within `head_s` of opening or of the request's first byte, and the request's
  body within `body_s` of its head; one that does not is closed. uvicorn alone times out
  only an idle kept-alive connection after a response, so a client that opens a connection
  and sends nothing, or a header line every few seconds, or a body a byte at a time, held it
  for as long as it liked: thousands of them made the server unreachable.
- `TrustedHosts`: the Host header must name this server (`Settings.allowed_hosts`), else
  400: a page on another site that a browser reaches through a DNS name pointed at this
  server (DNS rebinding) sends its own host name, and is refused before any route, the
  ingest fast path included.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from typing import Any

_LOCAL = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind: str) -> str:
    """The names this server answers to by default: localhost, the address it binds (unless
    it binds every address), this machine's host name and fully qualified name, and the
    addresses they resolve to (agents on other nodes reach it by one of those)."""
    names = list(_LOCAL)
    if bind not in ("0.0.0.0", "::", ""):
        names.append(bind)
    for name in {socket.gethostname(), socket.getfqdn()}:
        names.append(name)
        with contextlib.suppress(OSError):
            names += [str(info[4][0]) for info in socket.getaddrinfo(name, None)]
    return ",".join(dict.fromkeys(n.lower() for n in names if n))


def parse_hosts(value: str) -> frozenset[str] | None:
    """`Settings.allowed_hosts` as a set of lower-case names; None for "*" (any host)."""
    names = {n.strip().lower().strip("[]") for n in value.split(",") if n.strip()}
    return None if "*" in names else frozenset(names)


def _host_name(raw: bytes) -> str:
    """A Host header's name, without its port ("[::1]:8321" -> "::1")."""
    host = raw.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class TrustedHosts:
    """400 for an HTTP request whose Host header is not one of `allowed` (module
    docstring); `allowed` None lets every host through."""

    def __init__(self, app: Any, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.allowed is not None and scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), b"")
            if _host_name(host) not in self.allowed:
                body = b'{"detail":"the Host header does not name this server (allowed_hosts)"}'
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def deadline_protocol(head_s: float, body_s: float) -> Any:
    """uvicorn's httptools protocol with the head and body deadlines of the module
    docstring (server/deadlines.py), as a picklable factory: uvicorn hands it to each of
    `--workers` processes. None where httptools is missing (uvicorn's own protocol then)."""
    try:
        from zerowatch.server.deadlines import DeadlineProtocol
    except ImportError:
        return None
    return functools.partial(DeadlineProtocol, head_s=head_s, body_s=body_s)


__all__ = ["TrustedHosts", "deadline_protocol", "default_allowed_hosts", "parse_hosts"]
