"""The rank's heartbeat: what its training thread is doing, sent by the shipper thread.

A heartbeat goes out every `heartbeat_interval` seconds from the shipper thread, so it keeps
coming when the training thread is blocked (in a collective, in a data loader, on a lock):
the rank's last finished step and when, the phase it is in, and per process group the last
collective launched and the last completed with the newest calls (agent/probes/flight.py).
Once the rank has not finished a step for its stall threshold (`stall_after_s`: a multiple
of its own median step time, at least `stall_floor_s`), the heartbeat also carries the
training thread's innermost Python frames (`sys._current_frames()`): where it is stuck,
and the newest entries of torch's own flight recorder where torch keeps one (NCCL's, and
gloo's; `TORCH_FR_BUFFER_SIZE` > 0, which `zerowatch.init_distributed` sets): what the
process group itself has scheduled, started and completed.
The server keeps each rank's newest heartbeat; the doctor's hang and desync findings read
them (server/read/forensics.py, docs/forensics.md).

Nothing here runs on the training thread.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from typing import Any

from zerowatch.agent import codec
from zerowatch.agent.config import AgentConfig

from zerowatch import events as ev

#: Innermost frames a heartbeat carries.
STACK_FRAMES = 12


def stack_of(thread_id: int, limit: int = STACK_FRAMES) -> list[ev.Frame] | None:
    """The innermost `limit` frames of a thread, innermost first (None: no such thread)."""
    frame = sys._current_frames().get(thread_id)
    frames: list[ev.Frame] = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        frames.append(ev.Frame(file=code.co_filename, function=code.co_name,
                               line=int(frame.f_lineno or 0)))  # fmt: skip
        frame = frame.f_back
    return frames if frames else None


#: Torch flight-recorder entries a stalled heartbeat carries (the newest).
TORCH_ENTRIES = 8
#: What torch calls its flight recorder's size (its entries are kept only when it is > 0,
#: set before the process group is made); the older name is NCCL's.
TORCH_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def torch_flight(limit: int = TORCH_ENTRIES) -> list[dict[str, Any]] | None:
    """The newest entries of torch's own collective flight recorder (ProcessGroupNCCL's,
    and gloo's where torch keeps one), compacted: None where torch keeps none."""
    if not any(os.environ.get(v, "0").strip() not in ("", "0") for v in TORCH_BUFFER_VARS):
        return None
    entries: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        from torch._C import _distributed_c10d as c10d
    except Exception:  # no distributed build: the heartbeat goes without
        return None
    # torch 2.11 keeps NCCL's entries apart (its `_dump_nccl_trace_json`; the generic
    # recorder, gloo's, answers none of them): read both, each entry once.
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        try:
            got = json.loads(dump(True, False)).get("entries") or [] if dump else []
        except Exception:  # a recorder that is off or failed: the others still count
            continue
        for e in got:
            key = (str(e.get("process_group")), e.get("collective_seq_id"),
                   e.get("profiling_name"), e.get("time_created_ns"))  # fmt: skip
            if key not in seen:
                seen.add(key)
                entries.append(e)
    entries.sort(key=lambda e: float(e.get("time_created_ns", 0)))
    # What is still in flight first (the oldest of it is what the rank waits in), then the
    # newest of the rest, in torch's order.
    pending = [i for i, e in enumerate(entries) if not e.get("retired", False)][:limit]
    done = [i for i, e in enumerate(entries) if e.get("retired", False)]
    keep = sorted(pending + done[len(done) - (limit - len(pending)) :] if len(pending) < limit
                  else pending)  # fmt: skip
    out = []
    for e in (entries[i] for i in keep):
        pg = e.get("process_group") or ["", ""]
        out.append({
            "group": str(pg[1] if len(pg) > 1 else pg[0]),
            "seq": int(e.get("collective_seq_id", 0)),
            "op": str(e.get("profiling_name", "")),
            "state": str(e.get("state", "")),
            "retired": bool(e.get("retired", False)),
            "sizes": e.get("input_sizes"),
            "dtypes": e.get("input_dtypes"),
            "created": float(e.get("time_created_ns", 0)) / 1e9,
        })  # fmt: skip
    return out or None


class HeartbeatSource:
    """Builds this rank's heartbeat from its recorder (on the shipper thread).

    Args:
        recorder: the rank's StepRecorder (its flight recorder, last step, phase).
        config: stall threshold settings.
        rank, host, node: who sends it.
        thread_id: the training thread (default: the thread that builds this object).
    """

    def __init__(self, recorder: Any, config: AgentConfig, *, rank: int, host: str = "",
                 node: int = -1, thread_id: int | None = None) -> None:  # fmt: skip
        self._recorder = recorder
        self._cfg = config
        self.rank, self.host, self.node = rank, host, node
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()

    def stall_after_s(self) -> float:
        """The rank's stall threshold: `stall_factor` times its median step time of the
        last steps, at least `stall_floor_s`."""
        times = list(self._recorder.step_times)
        typical = statistics.median(times) if times else 0.0
        return max(self._cfg.stall_floor_s, self._cfg.stall_factor * typical)

    def build(self) -> ev.Heartbeat:
        rec = self._recorder
        now = time.perf_counter()
        stalled = rec.stalled_for(now)
        threshold = self.stall_after_s()
        to_unix = rec.unix_of(0.0)
        last = rec.last_step
        groups = {
            name: ev.GroupFlight(launched=g["launched"], completed=g["completed"],
                                 calls=g["calls"])
            for name, g in rec.flight.snapshot(to_unix).items()
        }  # fmt: skip
        stuck = stalled >= threshold
        return ev.Heartbeat(
            rank=self.rank,
            time=round(now + to_unix, 6),
            last_step=last,
            last_step_end=round(rec.last_step_end + to_unix, 6) if last is not None else None,
            phase=rec.phase_now(),
            stalled_s=round(stalled, 3),
            stall_after_s=round(threshold, 3),
            groups=groups,
            stack=stack_of(self.thread_id) if stuck else None,
            torch_flight=torch_flight() if stuck else None,
            host=self.host,
            node=self.node,
        )

    def body(self) -> bytes:
        """The POST body: a HeartbeatBatch of this rank's heartbeat."""
        return codec.dumps({"heartbeats": [codec.to_dict(self.build())]})


__all__ = ["STACK_FRAMES", "HeartbeatSource", "stack_of", "torch_flight"]
