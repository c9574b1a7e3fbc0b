"""`instrument(engine, ...)`: wire an engine to the agent and start shipping.

At instrument time, once per job, rank 0 draws the run id and start time and broadcasts
them over the engine's process group, and the ranks gather their host names: every rank's
agent then describes the same run (the RunCreate is identical on all ranks, and the server
creates a run idempotently on its id).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from zerowatch.agent import codec
from zerowatch.agent.adapters import EngineAdapter, JobInfo, select_adapter
from zerowatch.agent.client import IngestClient
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.probes import CudaClock, CudaMemoryProbe, HostClock, MemoryProbe
from zerowatch.agent.probes.gpu import DeviceIdentity, device_identity, gpu_probe
from zerowatch.agent.recorder import StepRecorder
from zerowatch.agent.run import Run
from zerowatch.agent.spool import Spool
from zerowatch.agent.transport import Transport

from zerowatch import __version__
from zerowatch import events as ev

DEFAULT_SPOOL_ROOT = "zerowatch-spool"
_SLUG = re.compile(r"[^a-z0-9]+")


def _slug(name: str) -> str:
    return _SLUG.sub("-", name.lower()).strip("-")[:40] or "run"


def _fallback_id() -> str:
    """An id every rank derives alike from the launcher's environment (no collectives)."""
    key = "|".join(
        os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    )
    return "run-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _agree(
    adapter: EngineAdapter, job: JobInfo, name: str | None, health: AgentHealth
) -> tuple[str, float, list[str]]:
    """(run id, start time, host name per rank), the same on every rank."""
    proposal = (f"{_slug(name) if name else 'run'}-{uuid.uuid4().hex[:12]}", time.time())
    try:
        run_id, started = adapter.broadcast_object(proposal, src=0)
    except Exception as e:
        health.error("agreeing on the run id over the process group", e)
        run_id, started = _fallback_id(), proposal[1]
    try:
        hosts = [str(h) for h in adapter.all_gather_object(socket.gethostname())]
    except Exception as e:
        health.error("gathering host names", e)
        hosts = [socket.gethostname()]
    return str(run_id), float(started), hosts


def _check_args(project: Any, tags: Any, run: Any) -> list[str]:
    if not isinstance(project, str) or not project.strip():
        raise ValueError(f"project: expected a non-empty string, got {project!r}")
    if run is not None and (not isinstance(run, str) or not run.strip()):
        raise ValueError(f"run: expected a non-empty run name, got {run!r}")
    if tags is None:
        return []
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags: expected a list of strings, got {tags!r}")
    return list(tags)


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return ""


def instrument(
    engine: Any,
    server: str | None = None,
    run: str | None = None,
    project: str = "default",
    tags: list[str] | None = None,
    token: str | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    optimizer: Any = None,
    **kw: Any,
) -> Run:
    """Attach the in-process agent to `engine` on this rank; call it on every rank.

    Args:
        engine: the engine from `zerowatch.initialize` (or anything an adapter in
            `zerowatch.agent.adapters` understands).
        server: the zerowatch server URL; default `$ZEROWATCH_SERVER`. Without one, events
            go to the local spool only, for `zerowatch upload`.
        run: a human-readable run name; the run id is derived from it plus a random part.
        project: the project the run belongs to.
        tags: free-form labels.
        token: the ingest token; default `$ZEROWATCH_TOKEN`.
        spool_dir: where the spool lives; this run's is `<spool_dir>/<run_id>/`
            (default `./zerowatch-spool/<run_id>/`).
        optimizer: FSDP2 only: the optimizer stepping the `fully_shard` model (its step
            hooks mark where each step ends).
        **kw: `AgentConfig` fields (spans_every, peak_flops, max_spool_bytes, ...).

    Returns:
        The `Run` (a context manager).

    Raises:
        TypeError / ValueError: naming the argument, for bad arguments or an engine no
        adapter understands. Nothing after the arguments are checked raises into training.
    """
    config = AgentConfig.from_kwargs(kw)
    tag_list = _check_args(project, tags, run)
    server = server if server is not None else (os.environ.get("ZEROWATCH_SERVER") or None)
    token = token if token is not None else (os.environ.get("ZEROWATCH_TOKEN") or None)
    client = (
        IngestClient(server, token, timeout_s=config.http_timeout_s,
                     attempts=config.retry_attempts, max_wait_s=config.retry_max_wait_s)
        if server
        else None
    )  # fmt: skip
    adapter = select_adapter(engine, optimizer=optimizer)
    job = adapter.info()
    health = AgentHealth()
    run_id, started, hosts = _agree(adapter, job, run, health)
    name = config.name or run or run_id

    run_create = ev.RunCreate(
        run_id=run_id,
        name=name,
        project=project,
        tags=tag_list,
        world_size=job.world_size,
        engine=job.engine,
        engine_info={
            **job.engine_info,
            "device": job.device,
            "micro_batch_size": job.micro_batch_size,
            "gradient_accumulation_steps": job.gradient_accumulation_steps,
            "persistent_params": job.persistent_params,
        },
        zero_stage=job.zero_stage,
        offload_optimizer=job.offload_optimizer,  # type: ignore[arg-type]
        offload_param=job.offload_param,  # type: ignore[arg-type]
        precision=job.precision,  # type: ignore[arg-type]
        config=job.config,
        param_count=job.param_count,
        hosts=hosts,
        torch_version=_torch_version(),
        zerowatch_version=__version__,
        theory=job.theory,
        theory_comm=job.theory_comm,
        started_at=started,
    )
    spool = Spool(
        Path(os.path.abspath(spool_dir if spool_dir is not None else DEFAULT_SPOOL_ROOT)) / run_id,
        job.rank,
        max_bytes=config.max_spool_bytes,
        segment_bytes=config.spool_segment_bytes,
        fsync_interval_s=config.fsync_interval_s,
        health=health,
    )
    transport = Transport(
        run_id=run_id,
        run_create=codec.dumps(codec.to_dict(run_create)),
        client=client,
        spool=spool,
        health=health,
        queue_size=config.queue_size,
        batch_max_events=config.batch_max_events,
        flush_interval_s=config.flush_interval(job.world_size),
        retry_max_wait_s=config.retry_max_wait_s,
        http_timeout_s=config.http_timeout_s,
        rank=job.rank,
    )
    on_cuda = job.device.startswith("cuda")
    device = adapter.torch_device() if on_cuda else None
    clock = CudaClock(device) if on_cuda else HostClock()
    memory = (
        CudaMemoryProbe(job.theory, device)
        if on_cuda
        else MemoryProbe(job.theory, every=config.memory_every)
    )
    gpu = gpu_probe(
        _gpu_identity(device, config.gpu_telemetry, health),
        health=health,
        rank=job.rank,
        interval_s=config.gpu_sample_interval_s,
    )
    seq = itertools.count()
    recorder = StepRecorder(
        adapter=adapter, job=job, config=config, health=health, clock=clock,
        memory=memory, emit=transport.submit, next_seq=lambda: next(seq), gpu=gpu,
    )  # fmt: skip
    handle = Run(
        run_id=run_id, name=name, job=job, adapter=adapter, recorder=recorder,
        transport=transport, memory=memory, health=health, config=config, server=server,
        next_seq=lambda: next(seq),
    )  # fmt: skip
    transport.every_wake(recorder.tidy)
    transport.start()
    gpu.start()
    adapter.attach(recorder)
    _close_at_exit(handle)
    if job.rank == 0:
        _announce(run_id, server, spool.run_dir if server is None else None)
    return handle


def _gpu_identity(device: Any, wanted: bool | None, health: AgentHealth) -> DeviceIdentity | None:
    """The GPU whose health this rank reports: its CUDA device; on a CPU run only when
    asked (`gpu_telemetry=True`: the GPU at LOCAL_RANK); None: no GPU telemetry."""
    if wanted is False:
        return None
    if device is not None:
        try:
            return device_identity(device)
        except Exception as e:
            health.error("finding the rank's GPU", e)
            return None
    if wanted:
        return DeviceIdentity(index=max(int(os.environ.get("LOCAL_RANK", "0") or 0), 0))
    return None


def _announce(run_id: str, server: str | None, spool_path: Path | None) -> None:
    """One line on rank 0's stderr: where to watch the run (or where it is spooled)."""
    if server:
        where = f"{server.rstrip('/')}/runs/{run_id}"
    else:
        where = f"no server: spooling to {spool_path} (send it with `zerowatch upload`)"
    print(f"zerowatch: run {run_id}: {where}", file=sys.stderr, flush=True)


def _close_at_exit(run: Run) -> None:
    """Close a run the program forgot to close, when the interpreter exits (a strong
    reference: a run whose handle was dropped still flushes and sends its EndEvent)."""

    def _close() -> None:
        if not run.closed:
            run.close()

    atexit.register(_close)


__all__ = ["DEFAULT_SPOOL_ROOT", "instrument"]
