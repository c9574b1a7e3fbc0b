"""Free TCP ports on 127.0.0.1, so that tests can run side by side."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind to port 0 and let the kernel pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
