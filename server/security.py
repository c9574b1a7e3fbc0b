"""Response headers that harden the pages a browser opens (and cost the API nothing).

Every response carries:

- `Content-Security-Policy`: scripts only from the server itself (`script-src 'self'`, no
  inline script, no `eval`), so markup that slipped into a page through a run name, a tag or
  a config value could not run even if escaping failed. The pages keep no inline script:
  their data travels in `<script type="application/json">` blocks, which browsers never
  execute, and their code is /static/zerowatch.js; plotly.js and Swagger UI are served by
  the server too. Inline *styles* stay allowed: Plotly and Swagger UI set style attributes
  as they draw, and a style cannot run code. `frame-ancestors 'none'` keeps the pages out
  of other sites' frames (clickjacking); `form-action 'self'` and `base-uri 'none'` keep
  forms and relative links pointed at this server.
- `X-Frame-Options: DENY`: the same for browsers that predate `frame-ancestors`.
- `X-Content-Type-Options: nosniff`: a JSON or text answer is never read as a script.
- `Referrer-Policy: same-origin`: a link out of a page does not hand run ids to other sites.

A redirect's `Location` is made relative (the path alone): a redirect never names the host
a request claimed. A plain ASGI middleware (no request body buffering), so the ingest path
pays only a list append per response.
"""

from __future__ import annotations

from typing import Any

#: The policy of every response (see the module docstring).
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data: blob:",
        "font-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)


def _relative(location: bytes) -> bytes:
    """A redirect's target without scheme and host ("http://h:1/runs/x" -> "/runs/x"): the
    server's redirects stay on the server whatever Host the request named."""
    for scheme in (b"http://", b"https://"):
        if location.startswith(scheme):
            rest = location[len(scheme) :]
            slash = rest.find(b"/")
            return rest[slash:] if slash >= 0 else b"/"
    return location


class SecurityHeadersMiddleware:
    """Add `HEADERS` to every HTTP response that does not set them itself."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, _relative(v) if k.lower() == b"location" else v)
                           for k, v in message.get("headers", ())]  # fmt: skip
                present = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in HEADERS if k not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


__all__ = ["CONTENT_SECURITY_POLICY", "HEADERS", "SecurityHeadersMiddleware"]
