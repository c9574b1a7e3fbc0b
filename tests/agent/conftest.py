"""A fake engine that announces phases and collectives like the bundled one, for the agent's
fast unit tests (the multi-rank tests use the real engine)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from zerowatch import theory
from zerowatch.engine.hooks import CollectiveRecord, ObserverRegistry


@dataclass
class LastStep:
    grad_norm: float | None = 1.5
    clipped: bool = False
    loss_scale: float | None = None
    skipped: bool = False
    lr: float | None = 1e-3
    nonfinite: bool = False


@dataclass
class FakeEngine:
    """Single-rank stand-in for zerowatch's engine: `train_step()` emits one step's hooks."""

    zero_stage: int = 2
    world_size: int = 2
    rank: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    num_parameters: int = 1000
    num_persistent_parameters: int = 0
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    global_steps: int = 0
    last_step: LastStep = field(default_factory=LastStep)
    registry: ObserverRegistry = field(default_factory=ObserverRegistry)
    #: Per train_step: the exposed seconds of the collectives it reported (what the agent
    #: must sum to its exposed communication time).
    exposed_by_step: list[float] = field(default_factory=list)

    def add_observer(self, obs: Any) -> None:
        self.registry.add(obs)

    def remove_observer(self, obs: Any) -> None:
        self.registry.remove(obs)

    def theory(self) -> theory.ModelStateBytes:
        return theory.model_state_bytes(self.num_parameters, self.world_size, self.zero_stage)

    def model_state_bytes(self) -> dict[str, int]:
        return self.theory().flat()

    def _phase(self, phase: str, seconds: float) -> None:
        self.registry.call("on_phase_start", phase, time.perf_counter())
        time.sleep(seconds)
        self.registry.call("on_phase_end", phase, time.perf_counter())

    def _collective(
        self, op: str, purpose: str, nbytes: int, seconds: float, async_op: bool = False
    ) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        t1 = time.perf_counter()
        rec = CollectiveRecord(op, purpose, nbytes, self.world_size, t0, t1, async_op,
                               0.0 if async_op else t1 - t0)  # fmt: skip
        self.exposed_by_step[-1] += rec.exposed_s
        self.registry.call("on_collective", rec)

    def train_step(self, *, fwd: float = 0.004, bwd: float = 0.006, opt: float = 0.002) -> None:
        """forward, backward with a nested grad_reduce (two reduce-scatters), optimizer step
        with an all-gather and a d2h/h2d copy pair."""
        reg = self.registry
        self.exposed_by_step.append(0.0)
        reg.call("on_phase_start", "step", time.perf_counter())
        self._phase("forward", fwd)
        reg.call("on_phase_start", "backward", time.perf_counter())
        time.sleep(bwd / 2)
        reg.call("on_phase_start", "grad_reduce", time.perf_counter())
        self._collective("reduce_scatter", "grad_reduce", 2000, 0.0002)
        self._collective("reduce_scatter", "grad_reduce", 2000, 0.0003, async_op=True)
        reg.call("on_phase_end", "grad_reduce", time.perf_counter())
        time.sleep(bwd / 2)
        reg.call("on_phase_end", "backward", time.perf_counter())
        reg.call("on_phase_start", "optimizer_step", time.perf_counter())
        t0 = time.perf_counter()
        reg.call("on_offload", "d2h", 4000, t0, t0 + 0.001)
        time.sleep(opt)
        self._collective("all_gather", "optimizer_gather", 4000, 0.0001)
        reg.call("on_phase_end", "optimizer_step", time.perf_counter())
        self.global_steps += 1
        reg.call("on_phase_end", "step", time.perf_counter())


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def spool_root(tmp_path: Path) -> Path:
    return tmp_path / "spool"


class FakeIngestServer:
    """A tiny HTTP server speaking the ingest API, whose behaviour a test switches:
    "ok" (stores, dedups on (rank, seq)), "500", "hang" (answers nothing until stopped),
    "401". `max_batch` makes it answer 413 to larger batches."""

    def __init__(self, mode: str = "ok", *, max_batch: int | None = None) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.mode = mode
        self.max_batch = max_batch
        self.events: dict[tuple[int, int], dict] = {}
        self.order: list[tuple[int, int]] = []
        self.runs: list[dict] = []
        self.requests = 0
        self.headers: list[dict[str, str]] = []
        self._release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                import json as _json

                data = _json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                import gzip
                import json as _json

                fake.requests += 1
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.headers.append(dict(self.headers))
                if fake.mode == "hang":
                    fake._release.wait(60)
                    return
                if fake.mode == "500":
                    return self._reply(500, {"detail": "boom"})
                if fake.mode == "401":
                    return self._reply(401, {"detail": "bad token"})
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                body = _json.loads(raw)
                if self.path.endswith("/runs"):
                    fake.runs.append(body)
                    return self._reply(201, body)
                if body["run_id"] not in {r["run_id"] for r in fake.runs}:
                    return self._reply(404, {"detail": "unknown run"})
                evs = body["events"]
                if fake.max_batch is not None and len(evs) > fake.max_batch:
                    return self._reply(413, {"detail": "too large"})
                accepted = dup = 0
                for e in evs:
                    key = (e["rank"], e["seq"])
                    if key in fake.events:
                        dup += 1
                    else:
                        fake.events[key] = e
                        fake.order.append(key)
                        accepted += 1
                return self._reply(200, {"accepted": accepted, "duplicates": dup})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def steps(self) -> list[dict]:
        return [self.events[k] for k in self.order if self.events[k]["kind"] == "step"]

    def stop(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fake_server():
    servers: list[FakeIngestServer] = []

    def make(mode: str = "ok", **kw: Any) -> FakeIngestServer:
        s = FakeIngestServer(mode, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()
