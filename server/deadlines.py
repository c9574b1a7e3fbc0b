"""uvicorn's httptools protocol with a deadline for a request's head and one for its body
(edge.py's module docstring says why). A module of its own: it imports httptools, which an
install may lack, and its class must be importable by name for uvicorn's worker processes."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class DeadlineProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """Closes a connection whose request head has not arrived `head_s` after it opened or
    after the request's first byte, or whose body has not arrived `body_s` after its head."""

    def __init__(self, *args: Any, head_s: float, body_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_s = head_s
        self._body_s = body_s
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self._head_s)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self._head_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self._body_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
