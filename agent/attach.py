"""`instrument(engine, ...)`: wire an engine to the agent and start shipping.

At instrument time, once per job:
- rank 0 draws the run id and start time and broadcasts them over the engine's process
  group (without a group, every rank derives the same id from the launcher's job id:
  `_fallback_id`). Rank 0 alone creates the run on the server (one gzip'd POST for the
  job, naming no hosts); the other ranks post their events to the id they were given,
  and each rank's events name its host and node (`recorder.launcher_node`);
- the ranks estimate their clock's offset to rank 0's over the same group
  (`zerowatch.clocks`), so every time they send is on rank 0's clock;
- the MFU meter is made from the device's peak (by its name) and the model's FLOPs per
  token (agent/flops.py);
- on a bundled engine, first of all, the ranks rehearse every stage's communication path
  and probe the link for the doctor (zerowatch/rehearse, about a second of collectives on a
  multi-rank CPU job; `rehearse=False` leaves it out): it arrives in the run's
  `engine_info["collective_calls"]` beside the calls the adapter counted.
"""

from __future__ import annotations

import atexit
import dataclasses
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

from zerowatch.agent import codec, flops, forensics
from zerowatch.agent.adapters import EngineAdapter, JobInfo, select_adapter
from zerowatch.agent.checkpoints import CheckpointTimer
from zerowatch.agent.client import IngestClient
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.heartbeat import HeartbeatSource
from zerowatch.agent.probes import CudaClock, CudaMemoryProbe, HostClock, MemoryProbe
from zerowatch.agent.probes.gpu import DeviceIdentity, device_identity, gpu_probe
from zerowatch.agent.recorder import StepRecorder, launcher_node
from zerowatch.agent.run import Run
from zerowatch.agent.spool import Spool
from zerowatch.agent.transport import Transport

from zerowatch import __version__, clocks
from zerowatch import events as ev

DEFAULT_SPOOL_ROOT = "zerowatch-spool"
_SLUG = re.compile(r"[^a-z0-9]+")


def _slug(name: str) -> str:
    return _SLUG.sub("-", name.lower()).strip("-")[:40] or "run"


#: The launcher's id of the job, the same on every rank (torchrun, SLURM, Open MPI's).
_JOB_ID_KEYS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_orte_ess_jobid",
                "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def _fallback_id(name: str | None = None) -> str:
    """An id every rank derives alike from the launcher's environment (no collectives)."""
    key = "|".join(os.environ.get(k, "") for k in _JOB_ID_KEYS)
    return f"{_slug(name) if name else 'run'}-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def job_key(job: str | None = None) -> str:
    """The job a run belongs to, the same for its restarts: `job`, else `$ZEROWATCH_JOB`,
    else the SLURM job id (kept by a requeue), else torchrun's run id (kept across its
    elastic restarts; `--standalone` draws a new one per launch); "" for none."""
    if job:
        return job
    if os.environ.get("ZEROWATCH_JOB"):
        return os.environ["ZEROWATCH_JOB"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    torchrun = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun-{torchrun}" if torchrun and torchrun != "none" else ""


def _agree(
    adapter: EngineAdapter, job: JobInfo, name: str | None, health: AgentHealth
) -> tuple[str, float]:
    """(run id, start time), the same on every rank."""
    proposal = (f"{_slug(name) if name else 'run'}-{uuid.uuid4().hex[:12]}", time.time())
    try:
        run_id, started = adapter.broadcast_object(proposal, src=0)
    except Exception as e:
        health.error("agreeing on the run id over the process group", e)
        run_id, started = _fallback_id(name), proposal[1]
    return str(run_id), float(started)


def _with_rehearsal(adapter: EngineAdapter, job: JobInfo, health: AgentHealth) -> JobInfo:
    """`job` with what the adapter measures for the doctor beside the steps (the bundled
    engine's: zerowatch/rehearse) merged into `engine_info["collective_calls"]`; `job` as
    it is for an adapter that measures nothing, or when the measuring fails (logged)."""
    measure = getattr(adapter, "rehearse", None)
    calls = job.engine_info.get("collective_calls")
    if measure is None or not isinstance(calls, dict):
        return job
    try:
        got = measure()
    except Exception as e:
        health.error("rehearsing the stages' communication for the doctor", e)
        return job
    if not got:
        return job
    return dataclasses.replace(
        job, engine_info={**job.engine_info, "collective_calls": {**calls, **got}}
    )


def _clock_offset(adapter: EngineAdapter, job: JobInfo, config: AgentConfig,
                  health: AgentHealth, fallback: float = 0.0) -> float:  # fmt: skip
    """This host's clock minus rank 0's, from a few round trips over the job's group;
    `fallback` on one rank, when turned off, or when the group fails (logged)."""
    if job.world_size < 2 or not config.clock_sync_rounds:
        return fallback
    try:
        offset, _ = clocks.offset_to_rank0(
            adapter.broadcast_object, adapter.all_gather_object, rank=job.rank,
            rounds=config.clock_sync_rounds,
        )  # fmt: skip
        return offset
    except Exception as e:
        health.error("estimating the clock offset to rank 0", e)
        return fallback


def _model_of(engine: Any, adapter: EngineAdapter) -> Any:
    """The nn.Module being trained (unwrapped from DDP / DeepSpeed), or None."""
    try:
        from torch import nn
    except ImportError:
        return None
    for candidate in (getattr(adapter, "model", None), getattr(engine, "module", None), engine):
        if isinstance(candidate, nn.Module):
            inner: Any = candidate
            while isinstance(getattr(inner, "module", None), nn.Module):
                inner = inner.module
            return inner
    return None


def device_name(device: Any) -> str | None:
    """torch.cuda.get_device_name of a CUDA device; None off CUDA or when it fails."""
    if device is None:
        return None
    try:
        import torch

        return str(torch.cuda.get_device_name(device))
    except Exception:
        return None


def _mfu_meter(engine: Any, adapter: EngineAdapter, job: JobInfo, config: AgentConfig,
               health: AgentHealth, device: Any) -> flops.MfuMeter:  # fmt: skip
    """MFU from the device's table peak and the model's FLOPs, hand input overriding each."""
    name = device_name(device)
    peak = config.peak_flops or flops.peak_flops(name, flops.matmul_dtype(job.precision))
    model: flops.ModelFlops | None = None
    module = _model_of(engine, adapter)
    if module is not None:
        try:
            model = flops.model_flops(module, param_count=job.param_count)
        except Exception as e:
            health.error("counting the model's FLOPs per token", e)
    elif job.param_count:
        model = flops.ModelFlops(params=job.param_count)
    if model is None and config.flops_params is not None:
        model = flops.ModelFlops(params=config.flops_params)
    if model is not None:
        given = {"params": config.flops_params, "num_layers": config.num_layers,
                 "hidden_size": config.hidden_size, "seq_len": config.seq_len}  # fmt: skip
        model = dataclasses.replace(model, **{k: v for k, v in given.items() if v is not None})
    return flops.MfuMeter(model=model, peak_flops=peak, flops_per_token=config.flops_per_token,
                          warn_once=health.warn_once, device_name=name)  # fmt: skip


def _check_args(project: Any, tags: Any, run: Any) -> list[str]:
    """The server's limits (server/store.py: RUN_TEXT_LIMITS, RUN_LIST_LIMITS), checked
    here so that a run the server would refuse fails at `instrument`, naming the argument."""
    if not isinstance(project, str) or not project.strip() or len(project) > 100:
        raise ValueError(f"project: expected a non-empty string of at most 100 characters, "
                         f"got {project!r}")  # fmt: skip
    if run is not None and (not isinstance(run, str) or not run.strip() or len(run) > 200):
        raise ValueError(f"run: expected a non-empty run name of at most 200 characters, "
                         f"got {run!r}")  # fmt: skip
    if tags is None:
        return []
    if (isinstance(tags, str) or not all(isinstance(t, str) and len(t) <= 100 for t in tags)
            or len(tags) > 64):  # fmt: skip
        raise ValueError(f"tags: expected a list of strings (at most 64, of at most 100 "
                         f"characters each), got {tags!r}")  # fmt: skip
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
    job: str | None = None,
    rehearse: bool = True,
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
        job: the job this run is part of: the runs of one job across restarts are one
            job on the server (its goodput). Default `$ZEROWATCH_JOB`, the SLURM job id or
            torchrun's run id (`job_key`).
        rehearse: on a bundled engine, rehearse every stage's communication path and
            probe the link for the doctor's predictions before anything else (a
            collective sequence, about a second on a multi-rank CPU job; nothing on one
            rank or a GPU). The same on every rank. False: the doctor prices without them.
        **kw: `AgentConfig` fields (spans_every, peak_flops, max_spool_bytes, ...).

    Returns:
        The `Run` (a context manager).

    Raises:
        TypeError / ValueError: naming the argument, for bad arguments or an engine no
        adapter understands. Nothing after the arguments are checked raises into training.
    """
    config = AgentConfig.from_kwargs(kw)
    tag_list = _check_args(project, tags, run)
    if job is not None and (not isinstance(job, str) or not job.strip() or len(job) > 200):
        raise ValueError(f"job: expected a non-empty name of at most 200 characters, got {job!r}")
    job_name = job_key(job)
    server = server if server is not None else (os.environ.get("ZEROWATCH_SERVER") or None)
    token = token if token is not None else (os.environ.get("ZEROWATCH_TOKEN") or None)
    client = (
        IngestClient(server, token, timeout_s=config.http_timeout_s,
                     attempts=config.retry_attempts, max_wait_s=config.retry_max_wait_s)
        if server
        else None
    )  # fmt: skip
    adapter = select_adapter(engine, optimizer=optimizer)
    info = adapter.info()
    health = AgentHealth()
    if rehearse:
        info = _with_rehearsal(adapter, info, health)
    run_id, started = _agree(adapter, info, run, health)
    clock_offset = _clock_offset(adapter, info, config, health)
    name = config.name or run or run_id

    run_create = ev.RunCreate(
        run_id=run_id,
        name=name,
        project=project,
        tags=tag_list,
        world_size=info.world_size,
        engine=info.engine,
        engine_info={
            **info.engine_info,
            "device": info.device,
            "micro_batch_size": info.micro_batch_size,
            "gradient_accumulation_steps": info.gradient_accumulation_steps,
            "persistent_params": info.persistent_params,
        },
        zero_stage=info.zero_stage,
        offload_optimizer=info.offload_optimizer,  # type: ignore[arg-type]
        offload_param=info.offload_param,  # type: ignore[arg-type]
        precision=info.precision,  # type: ignore[arg-type]
        config=info.config,
        param_count=info.param_count,
        hosts=[],  # each rank's events name its host and node
        torch_version=_torch_version(),
        zerowatch_version=__version__,
        theory=info.theory,
        theory_comm=info.theory_comm,
        started_at=started,
        job=job_name,
    )
    spool = Spool(
        Path(os.path.abspath(spool_dir if spool_dir is not None else DEFAULT_SPOOL_ROOT)) / run_id,
        info.rank,
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
        flush_interval_s=config.flush_interval(info.world_size),
        retry_max_wait_s=config.retry_max_wait_s,
        http_timeout_s=config.http_timeout_s,
        rank=info.rank,
        creates_run=info.rank == 0,
    )
    on_cuda = info.device.startswith("cuda")
    device = adapter.torch_device() if on_cuda else None
    clock = CudaClock(device) if on_cuda else HostClock()
    memory = (
        CudaMemoryProbe(info.theory, device)
        if on_cuda
        else MemoryProbe(info.theory, every=config.memory_every)
    )
    gpu = gpu_probe(
        _gpu_identity(device, config.gpu_telemetry, health),
        health=health,
        rank=info.rank,
        interval_s=config.gpu_sample_interval_s,
    )
    seq = itertools.count()
    recorder = StepRecorder(
        adapter=adapter, job=info, config=config, health=health, clock=clock,
        memory=memory, emit=transport.submit, next_seq=lambda: next(seq), gpu=gpu,
        mfu=_mfu_meter(engine, adapter, info, config, health, device),
    )  # fmt: skip
    recorder.set_clock_offset(clock_offset)
    if info.world_size > 1 and config.clock_sync_rounds:
        recorder.resync_clock = lambda: _clock_offset(
            adapter, info, config, health, fallback=recorder.clock_offset_s
        )
    checkpoints = CheckpointTimer(
        recorder.note_checkpoint, lambda: int(getattr(engine, "global_steps", 0) or 0),
        recorder.unix_of, health.error,
    )  # fmt: skip
    handle = Run(
        run_id=run_id, name=name, job=info, adapter=adapter, recorder=recorder,
        transport=transport, memory=memory, health=health, config=config, server=server,
        next_seq=lambda: next(seq), checkpoints=checkpoints,
    )  # fmt: skip
    recorder.on_crash = handle.crash
    recorder.tracer = _forward_tracer(engine, adapter, health)
    transport.every_wake(recorder.tidy)
    beat = HeartbeatSource(recorder, config, rank=info.rank, host=socket.gethostname(),
                           node=launcher_node())  # fmt: skip
    transport.heartbeat(beat.body, config.heartbeat_interval(info.world_size))
    transport.start()
    gpu.start()
    adapter.attach(recorder)
    checkpoints.attach(engine)
    _close_at_exit(handle)
    if info.rank == 0:
        _announce(run_id, server, spool.run_dir if server is None else None)
    return handle


def _forward_tracer(engine: Any, adapter: EngineAdapter,
                    health: AgentHealth) -> forensics.ForwardTracer | None:  # fmt: skip
    """The tracer of NaNs born in the forward (armed only after a flagged step)."""
    try:
        model = _model_of(engine, adapter)
    except Exception as e:
        health.error("finding the model to trace non-finite outputs", e)
        return None
    return forensics.ForwardTracer(model) if model is not None else None


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
