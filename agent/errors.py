"""Agent health: errors are logged once per place and counted, never raised into training.

The counts travel in the rank's `EndEvent` (`agent_errors`, `dropped_events`), so a run
whose agent struggled says so on the server.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("zerowatch.agent")


class AgentHealth:
    """Counters shared by the agent's parts (training thread and shipper thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.errors = 0
        self.dropped = 0

    def error(self, where: str, exc: BaseException | None = None) -> None:
        """Count an agent-internal error; log it the first time `where` fails."""
        with self._lock:
            self.errors += 1
            first = where not in self._logged
            self._logged.add(where)
        if first:
            log.warning(
                "zerowatch agent: %s failed (%s); training continues, further failures here "
                "are counted, not logged",
                where,
                exc if exc is not None else "error",
                exc_info=exc,
            )

    def drop(self, n: int, why: str) -> None:
        """Count `n` events lost (spool full, queue full, rejected); warn once per reason."""
        if n <= 0:
            return
        with self._lock:
            self.dropped += n
            first = f"drop:{why}" not in self._logged
            self._logged.add(f"drop:{why}")
        if first:
            log.warning(
                "zerowatch agent: dropping events: %s; training continues, the number "
                "dropped is reported when the run ends",
                why,
            )

    def warn_once(self, key: str, message: str, *args: object) -> None:
        """Log `message` the first time `key` is seen."""
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        if first:
            log.warning(message, *args)


__all__ = ["AgentHealth", "log"]
