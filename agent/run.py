"""`Run`: one rank's handle on an instrumented run (log scalars, close)."""

from __future__ import annotations

import math
import numbers
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from zerowatch.agent import forensics as fx
from zerowatch.agent.adapters.base import EngineAdapter, JobInfo
from zerowatch.agent.checkpoints import CheckpointTimer
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.probes import MemoryProbe
from zerowatch.agent.recorder import StepRecorder
from zerowatch.agent.transport import Transport

from zerowatch import events as ev


def _as_number(key: str, value: Any) -> float:
    """A logged value as float; a TypeError naming the key for anything not a real number."""
    kind = type(value)
    if kind is float or kind is int:  # (the usual case, without the ABC check below)
        return float(value)
    if isinstance(value, bool):
        raise TypeError(f"run.log: {key}={value!r}: expected a number, got a bool")
    if isinstance(value, numbers.Real):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "item"):  # a one-element tensor / array
        if numel() != 1:
            raise TypeError(f"run.log: {key}: expected a number or a one-element tensor, "
                            f"got a tensor of {numel()} elements")  # fmt: skip
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    raise TypeError(f"run.log: {key}={value!r}: expected a number, got {type(value).__name__}")


class Run:
    """What `zerowatch.instrument()` returns; one per rank, all ranks of a job share `id`.

    Use as a context manager (`with zerowatch.instrument(engine) as run:`) or call
    `close()` at the end. An exception that leaves the engine or the block crashes the
    run (`crash`): its last event carries the exception, and the exception goes on
    unchanged; KeyboardInterrupt and the like mark the rank failed.
    """

    def __init__(
        self,
        *,
        run_id: str,
        name: str,
        job: JobInfo,
        adapter: EngineAdapter,
        recorder: StepRecorder,
        transport: Transport,
        memory: MemoryProbe,
        health: AgentHealth,
        config: AgentConfig,
        server: str | None,
        next_seq: Any,
        checkpoints: CheckpointTimer | None = None,
    ) -> None:
        self.id = run_id
        self.name = name
        self.rank = job.rank
        self.world_size = job.world_size
        self.server = server
        self.spool_path = Path(transport.spool.run_dir)
        self.config = config
        self._job = job
        self._adapter = adapter
        self._recorder = recorder
        self._transport = transport
        self._memory = memory
        self._health = health
        self._next_seq = next_seq
        self._checkpoints = checkpoints
        self._close_lock = threading.Lock()
        self.closed = False
        self.status: str = "running"

    # -- user API --------------------------------------------------------------------

    def log(self, **scalars: Any) -> None:
        """Add user scalars (loss, tokens, samples, anything numeric) to the current step.

        Called after `engine.step()`, the values belong to the step that just ended; called
        during a step (e.g. per micro-batch), to that step. `tokens` and `samples` add up
        over a step's calls (tokens/s, samples/s and MFU come from them), `loss` is
        averaged, `lr` and `grad_norm` become the step's learning rate and gradient norm
        (what the training framework reports wins over what the agent read from the
        optimizer), other keys keep their last value. A one-element tensor is accepted
        (reading it waits for the device, as `.item()` does).

        `batch_ids` (a list of ids of the step's samples, or one id) is kept in the event of
        a step whose loss or gradient was not finite (docs/forensics.md), not otherwise.

        Raises:
            TypeError: a value is not a real number (the message names the key).
        """
        ids = scalars.pop("batch_ids", None)
        batch_ids = _batch_ids(ids) if ids is not None else None
        # One pass (it runs on the training thread every step): plain floats and ints
        # without the checks of anything else.
        clean: dict[str, float] = {}
        nonfinite: list[tuple[str, float]] = []
        isfinite = math.isfinite
        for key, value in scalars.items():
            kind = type(value)
            number = float(value) if kind is float or kind is int else _as_number(key, value)
            if isfinite(number) or key == "loss":  # a non-finite loss flags the step
                clean[key] = number
            else:
                nonfinite.append((key, number))
        if self.closed:
            return
        for key, value in nonfinite:
            self._health.warn_once(
                f"nonfinite:{key}",
                "zerowatch: run.log(%s=%r): non-finite values are not stored",
                key,
                value,
            )
        try:
            self._recorder.log(clean, batch_ids)
        except Exception as e:
            self._health.error("run.log", e)

    def close(self, status: str | None = None, error: str | None = None,
              crash: dict[str, Any] | None = None, timeout_s: float | None = None) -> None:  # fmt: skip
        """Flush, send this rank's EndEvent and stop shipping (idempotent).

        Args:
            status: "finished" (default), "failed" or "crashed".
            error: a short description of the failure.
            crash: with "crashed": the crash report (agent/forensics.crash_report).
            timeout_s: how long sending may take (default `close_timeout_s`).
        """
        status = status or "finished"
        if status not in ("finished", "failed", "crashed"):
            raise ValueError(f"status: expected 'finished', 'failed' or 'crashed', got {status!r}")
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        self.status = status
        try:
            self._adapter.detach(self._recorder)
            if self._checkpoints is not None:
                self._checkpoints.detach()
        except Exception as e:
            self._health.error("detaching from the engine", e)
        try:
            self._recorder.flush()
        except Exception as e:
            self._health.error("flushing the last steps", e)
        end = ev.EndEvent(
            rank=self.rank,
            seq=self._next_seq(),
            time=time.time(),
            status=status,  # type: ignore[arg-type]
            error=error[:2000] if error else None,
            crash=crash,
            checkpoints=self._recorder.take_checkpoints(),
        )
        try:
            self._transport.close(
                end, self.config.close_timeout_s if timeout_s is None else timeout_s
            )
        except Exception as e:
            self._health.error("closing the shipper", e)
        self._memory.close()
        self._recorder.gpu.close()

    def crash(self, error: BaseException, phase: str, step: int | None = None) -> None:
        """Send this rank's last event for `error` (type, message, stack, step, phase; on
        out-of-memory the memory waterfall) and close the run as crashed, waiting at most
        `crash_flush_s` for the server. Never raises: the caller re-raises `error`."""
        if self.closed:
            return
        try:
            step = self._recorder.current_step() if step is None else step
            memory = None
            if fx.is_oom(error):
                try:
                    memory = fx.memory_at_crash(self._adapter.model_state_bytes(), self._job,
                                                error)  # fmt: skip
                except Exception as e:
                    self._health.error("reading memory at an out-of-memory error", e)
            report = fx.crash_report(error, phase=phase, step=step, memory=memory)
            self.close(status="crashed", error=f"{type(error).__name__}: {error}",
                       crash=report, timeout_s=self.config.crash_flush_s)  # fmt: skip
        except Exception as e:
            self._health.error("reporting a crash", e)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        elif isinstance(exc, Exception):
            self.crash(exc, self._recorder.phase_now())
        else:
            self.close(status="failed", error=f"{exc_type.__name__}: {exc}")

    # -- health ----------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """What this rank's agent did: steps recorded, events sent/spooled/dropped, errors."""
        t = self._transport.stats
        return {
            "run_id": self.id,
            "rank": self.rank,
            "steps": self._recorder.steps_emitted,
            "submitted": t.submitted,
            "sent": t.sent,
            "accepted": t.accepted,
            "duplicates": t.duplicates,
            "spooled": t.spooled,
            "told_to_wait": t.told_to_wait,
            "spool_bytes": self._transport.spool.bytes_on_disk,
            "queue_peak": t.queue_peak,
            "dropped_events": self._health.dropped,
            "agent_errors": self._health.errors,
        }

    def __repr__(self) -> str:
        return f"Run(id={self.id!r}, rank={self.rank}, status={self.status!r})"


def _batch_ids(ids: Any) -> list[Any]:
    """`run.log(batch_ids=...)` as a JSON-ready list (ints and strings; at most 1,024)."""
    if isinstance(ids, str | int) or not hasattr(ids, "__iter__"):
        ids = [ids]
    elif hasattr(ids, "tolist"):
        ids = ids.tolist()
    out = [i if isinstance(i, int | str) and not isinstance(i, bool) else str(i)
           for i in list(ids)[:1024]]  # fmt: skip
    return out


__all__ = ["Run"]
