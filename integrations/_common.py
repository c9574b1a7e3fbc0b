"""What the Trainer callbacks share: instrumenting without ever failing training, and
marking a run failed when the program dies of an uncaught exception."""

from __future__ import annotations

import logging
import sys
import threading
from types import TracebackType
from typing import Any

from zerowatch.agent.attach import _check_args

log = logging.getLogger("zerowatch.integrations")


class RunSettings:
    """`instrument()`'s arguments, checked when the callback is made (not mid-training)."""

    def __init__(self, server: str | None, run: str | None, project: str,
                 tags: list[str] | None, token: str | None, options: dict[str, Any]) -> None:  # fmt: skip
        _check_args(project, tags, run)
        self.kwargs = {"server": server, "run": run, "project": project, "tags": tags,
                       "token": token, **options}  # fmt: skip

    def instrument(self, target: Any, **extra: Any) -> Any:
        """`zerowatch.instrument(target, ...)`, or None (logged) when it cannot attach:
        a callback never stops training."""
        from zerowatch.agent import instrument

        try:
            run = instrument(target, **self.kwargs, **extra)
        except Exception as e:
            log.warning("zerowatch: not instrumenting this training run: %s", e)
            return None
        _close_failed_on_uncaught(run)
        return run


_hook_lock = threading.Lock()
_open_runs: list[Any] = []


def _close_failed_on_uncaught(run: Any) -> None:
    """Close `run` as failed if the program ends on an uncaught exception (before the
    agent's exit handler closes it as finished)."""
    with _hook_lock:
        _open_runs[:] = [r for r in _open_runs if not r.closed]
        _open_runs.append(run)
        if getattr(sys.excepthook, "__zerowatch__", False):
            return
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException,
                       tb: TracebackType | None) -> None:  # fmt: skip
            for open_run in list(_open_runs):
                if not open_run.closed:
                    open_run.close(status="failed", error=f"{kind.__name__}: {value}")
            previous(kind, value, tb)

        excepthook.__zerowatch__ = True  # type: ignore[attr-defined]
        sys.excepthook = excepthook


def close(run: Any, status: str = "finished", error: str | None = None) -> None:
    if run is not None and not run.closed:
        run.close(status=status, error=error)


__all__ = ["RunSettings", "close"]
