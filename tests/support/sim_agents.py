"""Simulated agents: many ranks of one run in one process, each with the agent's real
shipper, spool and HTTP client (zerowatch.agent.transport / spool / client), and no torch.

    from support.sim_agents import SimAgents, prefill_spools

    run_id = ...; spec = simulate.SimSpec(world_size=64)
    prefill_spools(spool_root, spec, run_id, ranks=range(64), steps=300)  # a 5-minute outage
    agents = SimAgents(server_url, spec, run_id, ranks=range(64), spool_root=spool_root)
    agents.start()                 # every rank's shipper replays its spool: a recovery storm
    agents.step()                  # one more training step on every rank (live events)
    agents.wait_drained(60)
    agents.close()
    agents.stats()                 # summed TransportStats: sent, accepted, duplicates, ...

The events are zerowatch.simulate's, made cheaply: each rank's event is built once and then
written for every step with its step, seq and time changed (bytes for the spool, a copied
dataclass for the live events), so that a thousand ranks of five minutes of steps are
written in seconds. `client_factory` lets a test wrap the HTTP client (to record what it
sent and when). `run_creator=0` has rank 0 alone create the run, as the agent does; by
default every rank creates it, as agents did before.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from zerowatch.agent import codec
from zerowatch.agent.client import IngestClient, ServerUnavailable
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.spool import Spool
from zerowatch.agent.transport import Transport, TransportStats

from zerowatch import events as ev
from zerowatch import simulate

#: The agent's defaults, except for what the simulation must shrink.
AGENT_DEFAULTS: dict[str, Any] = {
    "queue_size": 4096,
    "batch_max_events": 64,
    "flush_interval_s": None,  # the agent's: AgentConfig.flush_interval(world size)
    "retry_attempts": 3,
    "retry_max_wait_s": 2.0,
    "http_timeout_s": 5.0,
    "max_spool_bytes": 512 * 2**20,
    "spool_segment_bytes": 4 * 2**20,
    "fsync_interval_s": 1.0,
}


def run_create_json(spec: simulate.SimSpec, run_id: str, *, hosts: bool = True) -> bytes:
    """The RunCreate's JSON; `hosts=False`: without the host list, as today's agent sends
    it (its ranks' events name their hosts)."""
    rc = simulate.run_create(spec, run_id)
    if not hosts:
        rc.hosts = []
    return codec.dumps(codec.to_dict(rc))


class _Lines:
    """One rank's spool lines for any step, from two encoded templates (with and without
    spans)."""

    def __init__(self, spec: simulate.SimSpec, rank: int) -> None:
        self.rank = rank
        self.every = spec.spans_every
        self.tails: dict[bool, bytes] = {}
        for step in (0, 1):
            line = codec.encode(simulate.step_event(spec, rank, step))
            cut = line.index(b',"step_time_s"')
            self.tails[step % max(self.every, 1) == 0 and self.every > 0] = line[cut:]
        if False not in self.tails:  # spans on every step
            self.tails[False] = self.tails[True]

    def line(self, step: int, t: float) -> bytes:
        spans = self.every > 0 and step % self.every == 0
        head = b'{"rank":%d,"seq":%d,"step":%d,"time":%.3f' % (self.rank, step, step, t)
        return head + self.tails[spans]


def prefill_spools(
    spool_root: Path,
    spec: simulate.SimSpec,
    run_id: str,
    *,
    ranks: Iterable[int],
    steps: int,
    step_s: float = 1.0,
) -> int:
    """Write `steps` steps (seq 0..steps-1) of every rank into its spool, through the
    agent's Spool, as an outage of `steps * step_s` seconds leaves them. Returns the events
    written."""
    run_dir = Path(spool_root) / run_id
    t0 = time.time() - steps * step_s
    written = 0
    for rank in ranks:
        health = AgentHealth()
        spool = _spool(run_dir, rank, health)
        spool.write_run(run_create_json(spec, run_id))
        lines = _Lines(spec, rank)
        chunk: list[bytes] = []
        for step in range(steps):
            chunk.append(lines.line(step, t0 + step * step_s))
            if len(chunk) == 256:
                written += spool.append(chunk)
                chunk = []
        written += spool.append(chunk)
        spool.close()
        if health.dropped or health.errors:
            raise RuntimeError(f"rank {rank}: the spool refused events ({health.dropped})")
    return written


def _spool(run_dir: Path, rank: int, health: AgentHealth) -> Spool:
    return Spool(
        run_dir,
        rank,
        max_bytes=AGENT_DEFAULTS["max_spool_bytes"],
        segment_bytes=AGENT_DEFAULTS["spool_segment_bytes"],
        fsync_interval_s=AGENT_DEFAULTS["fsync_interval_s"],
        health=health,
    )


class SimAgents:
    """The shippers of `ranks` (see the module docstring)."""

    def __init__(
        self,
        server: str,
        spec: simulate.SimSpec,
        run_id: str,
        *,
        ranks: Iterable[int],
        spool_root: Path,
        next_step: int = 0,
        client_factory: Callable[..., IngestClient] = IngestClient,
        run_creator: int | None = None,
        **agent: Any,
    ) -> None:
        cfg = {**AGENT_DEFAULTS, **agent}
        self.spec = spec
        self.run_id = run_id
        self.next_step = next_step
        self.transports: list[Transport] = []
        self.healths: list[AgentHealth] = []
        self._templates: list[ev.StepEvent] = []
        run_dir = Path(spool_root) / run_id
        create = run_create_json(spec, run_id, hosts=run_creator is None)
        for rank in ranks:
            health = AgentHealth()
            client = client_factory(
                server,
                timeout_s=cfg["http_timeout_s"],
                attempts=cfg["retry_attempts"],
                max_wait_s=cfg["retry_max_wait_s"],
            )
            self.transports.append(
                Transport(
                    run_id=run_id,
                    run_create=create,
                    client=client,
                    spool=_spool(run_dir, rank, health),
                    health=health,
                    queue_size=cfg["queue_size"],
                    batch_max_events=cfg["batch_max_events"],
                    flush_interval_s=AgentConfig(
                        flush_interval_s=cfg["flush_interval_s"]
                    ).flush_interval(spec.world_size),
                    retry_max_wait_s=cfg["retry_max_wait_s"],
                    http_timeout_s=cfg["http_timeout_s"],
                    rank=rank,
                    creates_run=run_creator is None or rank == run_creator,
                )
            )
            self.healths.append(health)
            self._templates.append(simulate.step_event(spec, rank, 1))

    def start(self) -> None:
        for t in self.transports:
            t.start()

    def step(self) -> int:
        """One more training step on every rank: hand its event to the shipper (never
        blocks). Returns the step."""
        step, now = self.next_step, time.time()
        for t, tpl in zip(self.transports, self._templates, strict=True):
            t.submit(dataclasses.replace(tpl, seq=step, step=step, time=now))
        self.next_step += 1
        return step

    def pending(self) -> int:
        """Ranks with events not yet at the server (spooled or queued)."""
        return sum(1 for t in self.transports if t.spool.pending or t.queued)

    def wait_drained(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.pending():
                return True
            time.sleep(0.2)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every shipper (in parallel: each may spend up to `timeout_s`)."""
        with ThreadPoolExecutor(max_workers=64) as pool:
            list(pool.map(lambda t: t.close(None, timeout_s), self.transports))

    def stats(self) -> TransportStats:
        out = TransportStats()
        for t in self.transports:
            for f in dataclasses.fields(TransportStats):
                if f.name == "online":
                    continue
                v = getattr(t.stats, f.name)
                if f.name == "queue_peak":
                    out.queue_peak = max(out.queue_peak, v)
                else:
                    setattr(out, f.name, getattr(out, f.name) + v)
        return out

    @property
    def dropped(self) -> int:
        return sum(h.dropped for h in self.healths)


class RecordingClient(IngestClient):
    """The agent's client, noting when each POST started and ended and what it was told."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: (started, ended, status, retry_after_s) per POST of events.
        self.posts: list[tuple[float, float, int, float | None]] = []
        #: The bodies of its POSTs of a run (as sent: gzip).
        self.creations: list[bytes] = []

    def _post(self, path: str, **kw: Any) -> httpx.Response:
        if path == "/api/v1/runs":
            self.creations.append(kw["content"])
        t0 = time.monotonic()
        try:
            resp = super()._post(path, **kw)
        except ServerUnavailable as e:
            if path.endswith("/events"):
                status = int(str(e).split(" ", 1)[0]) if str(e)[:3].isdigit() else 0
                self.posts.append((t0, time.monotonic(), status, e.retry_after_s))
            raise
        if path.endswith("/events"):
            self.posts.append((t0, time.monotonic(), resp.status_code, None))
        return resp

    def statuses(self) -> set[int]:
        return {p[2] for p in self.posts}


def stored(db_url: str, run_id: str) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Per rank: the seqs stored (sorted) and the server's own count of its steps."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            pk = c.execute(text("SELECT id FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
            seqs: dict[int, list[int]] = defaultdict(list)
            for rank, seq in c.execute(
                text("SELECT rank, seq FROM steps WHERE run = :p ORDER BY rank, seq"), {"p": pk}
            ):
                seqs[rank].append(seq)
            rows = c.execute(text("SELECT rank, steps FROM rank_states WHERE run = :p"), {"p": pk})
            counts = {rank: n for rank, n in rows}
    finally:
        engine.dispose()
    return seqs, counts


__all__ = [
    "AGENT_DEFAULTS",
    "RecordingClient",
    "SimAgents",
    "prefill_spools",
    "run_create_json",
    "stored",
]


def post_heartbeats(http: httpx.Client, spec: simulate.SimSpec, run_id: str, *,
                    t: float | None = None, stalled_s: float = 30.0, batch: int = 512,
                    prefix: str = "") -> int:  # fmt: skip
    """Every rank's simulated heartbeat (simulate.heartbeats) POSTed to the run, `batch`
    ranks a request (`http`: an httpx.Client, or the app's TestClient; `prefix`: the
    server's URL for a plain client). Returns how many the server stored."""
    beats = simulate.heartbeats(spec, t=t, stalled_s=stalled_s)
    stored = 0
    for i in range(0, len(beats), batch):
        body = codec.dumps({"heartbeats": [codec.to_dict(b) for b in beats[i : i + batch]]})
        r = http.post(f"{prefix}/api/v1/runs/{run_id}/heartbeats", content=body,
                      headers={"Content-Type": "application/json"})  # fmt: skip
        r.raise_for_status()
        stored += int(r.json()["stored"])
    return stored
