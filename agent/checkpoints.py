"""Checkpoint saves and loads, timed per rank outside the steps.

`CheckpointTimer.attach(engine)` wraps the engine's `save_checkpoint` and `load_checkpoint`
(the bundled engine's and DeepSpeed's have the same names and arguments) on the instance,
so the user's calls go through it unchanged: what they return and raise is the engine's.
Each call becomes an `events.CheckpointTiming`: its wall-clock seconds on this rank, the
bytes this process wrote (save) or read (load) meanwhile, from the kernel's per-process
I/O counters (`/proc/self/io`'s wchar / rchar through psutil: every byte passed to a
write or read call, cached or not, so what the checkpoint's files took, and whatever else
the process read or wrote during the call), and the engine's global step when it returned.
After a load the recorder numbers the steps from the step it restored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerowatch import events as ev

_METHODS = (("save", "save_checkpoint"), ("load", "load_checkpoint"))


def _io_counter(op: str) -> Callable[[], int | None]:
    """This process's bytes written (save) or read (load) so far; None where not counted."""
    try:
        import psutil

        proc = psutil.Process()
        field = "write_chars" if op == "save" else "read_chars"
        getattr(proc.io_counters(), field)
    except Exception:
        return lambda: None
    return lambda: int(getattr(proc.io_counters(), field))


class CheckpointTimer:
    """Times one engine's checkpoint calls into `note(timing)`.

    Args:
        note: where each call's timing goes (the recorder's `note_checkpoint`).
        global_step: reads the engine's global step.
        unix_of: a perf_counter reading -> unix seconds on rank 0's clock.
        failed: reports an error of the timing itself (never of the call).
    """

    def __init__(self, note: Callable[[ev.CheckpointTiming], None],
                 global_step: Callable[[], int], unix_of: Callable[[float], float],
                 failed: Callable[[str, Exception], None]) -> None:  # fmt: skip
        self._note = note
        self._global_step = global_step
        self._unix_of = unix_of
        self._failed = failed
        self._wrapped: list[tuple[Any, str]] = []

    def attach(self, engine: Any) -> None:
        for op, name in _METHODS:
            call = getattr(engine, name, None)
            if callable(call):
                setattr(engine, name, self._timed(op, call))
                self._wrapped.append((engine, name))

    def detach(self) -> None:
        """The engine's own methods again."""
        for engine, name in self._wrapped:
            vars(engine).pop(name, None)
        self._wrapped = []

    def _timed(self, op: str, call: Callable[..., Any]) -> Callable[..., Any]:
        counter = _io_counter(op)

        def timed(*args: Any, **kwargs: Any) -> Any:
            before, t0 = counter(), time.perf_counter()
            out = call(*args, **kwargs)  # the engine's answer or exception, unchanged
            seconds = time.perf_counter() - t0
            try:
                after = counter()
                nbytes = after - before if after is not None and before is not None else None
                tag = kwargs.get("tag", args[1] if len(args) > 1 else None)
                if tag is None and isinstance(out, str):  # the bundled engine's directory
                    tag = Path(out).name
                self._note(ev.CheckpointTiming(
                    op=op, step=int(self._global_step()), time=self._unix_of(t0),  # type: ignore[arg-type]
                    seconds=seconds, bytes=nbytes, tag=str(tag) if tag is not None else "",
                ))  # fmt: skip
            except Exception as e:
                self._failed(f"timing {op}_checkpoint", e)
            return out

        timed.__wrapped__ = call  # type: ignore[attr-defined]
        timed.__doc__ = call.__doc__
        return timed


__all__ = ["CheckpointTimer"]
